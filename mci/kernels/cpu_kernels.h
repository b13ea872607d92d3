/* What the CPU kernels' translation units share (mci/kernels/build.py builds them into
 * one library): bf16 conversions, the output sink of the matmuls, the vector exp. */
#ifndef MCI_CPU_KERNELS_H
#define MCI_CPU_KERNELS_H

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#ifndef __AVX512F__
#include "cpu_avx2.h" /* the AVX2 build: the 512-bit operations as two 256-bit halves */
#endif

/* Elementwise work between the matmuls (silu, copies of x, residual and shared-expert sums,
 * rope, latent rows, routing) splits over the threads from this many elements: 32 decoding
 * tokens of `small` (hidden 512, inter 256) split, one stays on a thread. Measured at 32
 * tokens on a 2-core Zen 4 EPYC (at 65,536 before): an MoE layer's work outside its matmuls
 * 123 -> ~50 us. */
#define PARALLEL_ELEMENTS 8192

/* ---- a kernel alone, or one of several in a team --------------------------------------------
 * A kernel starts its own team of threads, or, called inside an active parallel region (a
 * caller such as mci_mla_decode runs a layer's kernels in one team), works as one thread of
 * that team. Starting and joining a team costs ~1 us here, a barrier inside one ~0.3 us (an
 * empty region against a barrier, 2 threads); a one-token decode step started 80 teams. Which
 * thread computes an output never changes its sum, so a kernel's bits are the same either way.
 * Invariant: inside a region, every thread of the team calls the same kernels in the same
 * order, and none calls one from a worksharing loop, `single` or `master` (it would do one
 * thread's share, then wait at a barrier the others never reach). */

/* The body (its share by omp_get_thread_num() of omp_get_num_threads()) in a new team, or
 * this thread's share and then a barrier: every output written before any thread goes on. */
#define TEAM_WORK(...)                                                                      \
    do {                                                                                    \
        if (omp_in_parallel()) {                                                            \
            __VA_ARGS__                                                                     \
            _Pragma("omp barrier")                                                          \
        } else {                                                                            \
            _Pragma("omp parallel") { __VA_ARGS__ }                                         \
        }                                                                                   \
    } while (0)

/* The body as one team: the caller's, where it is one of a team already, else a new one. Its
 * buffers are the caller's (a malloc in the body would give each thread its own). */
#define ONE_TEAM(...)                                                                       \
    do {                                                                                    \
        if (omp_in_parallel()) {                                                            \
            __VA_ARGS__                                                                     \
        } else {                                                                            \
            _Pragma("omp parallel") { __VA_ARGS__ }                                         \
        }                                                                                   \
    } while (0)

/* The loop `head body` over independent iterations: in a team, shared among its threads (a
 * barrier after); alone, in a new team where `enough` holds, else on this thread without a
 * team at all (an `if` clause still makes a team of one, ~0.25 us: a one-token decode step
 * made 100). */
#define PARALLEL_FOR(enough, head, ...)                                                     \
    do {                                                                                    \
        if (omp_in_parallel()) {                                                            \
            _Pragma("omp for schedule(static)") head { __VA_ARGS__ }                        \
        } else if (enough) {                                                                \
            _Pragma("omp parallel for schedule(static)") head { __VA_ARGS__ }               \
        } else {                                                                            \
            head { __VA_ARGS__ }                                                            \
        }                                                                                   \
    } while (0)

/* `bytes` on a 64-byte boundary (free() releases it), for buffers whose rows AMX tiles load
 * or a kernel's 64-byte vectors store: malloc aligns to 16 bytes only, and from a base that
 * is not on a 64-byte boundary every 64-byte row spans two cache lines. Measured on `small`'s
 * first MoE layer at a 1,056-token prefill, one process: its AMX gate_up call took 1,373 us
 * on mci_moe's malloc'd rows (run twice, the second timed) against 1,027 us for the same
 * call, counts and weights on torch's 64-byte aligned tensors; 1,154 against 1,107 with
 * these buffers from here. */
static inline void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

static inline uint16_t round_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_float(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

/* Where a block's results go: bf16 rows y (row stride ldy), or, to combine routed experts'
 * outputs, added into float32 rows acc (row stride ldy) as acc[tok[j]] += wt[j] * y_j, with
 * y_j rounded to bf16 first: the same float32 products and sums, in the same order, as
 * mci/layers/moe.py's weighted index_add over assignments sorted by expert. */
typedef struct {
    uint16_t *y;
    long ldy;
    float *acc;
    const int64_t *tok;
    const float *wt;
} Sink;

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

/* 16 float32 -> bf16, rounded to nearest even (round_bf16's result for every finite value
 * above the float32 denormals, which the instruction flushes to zero) */
static inline __m256i round16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

/* 16 bf16 -> float32 (exact) */
static inline __m512 widen16(__m256i b) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

#ifdef __AVX512F__
/* 16 float32 -> their bf16 bits in the low half of each lane, exactly as round_bf16 rounds
 * (to nearest even on the bits, denormals too; NaN kept quiet) */
static inline __m512i rne32(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

static inline __m256i rne16(__m512 v) { return _mm512_cvtepi32_epi16(rne32(v)); }

/* Sixteen sums at once: lane 4q + p of the result is _mm512_reduce_add_ps(v[4p + q]) bit for
 * bit. That reduction adds lane i to lane i + 8, then i + 4, i + 2, i + 1 (GCC's
 * avx512fintrin.h; float addition is commutative, so a pair's order does not matter); here the
 * same pairs are added, two shuffles and one add per pair of vectors at each level: 45
 * operations for 16 sums, where one sum alone takes about 8. */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 *v) {
    __m512 s[8], t[4], u[2];
    for (int i = 0; i < 8; i++) /* lanes i + 8 of each vector: the 256-bit halves */
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44));
    for (int i = 0; i < 4; i++) /* lanes i + 4: the 128-bit quarters */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88));
    for (int i = 0; i < 2; i++) /* lanes i + 2, within each quarter */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44));
    return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0xDD),  /* lanes i + 1 */
                         _mm512_shuffle_ps(u[0], u[1], 0x88));
}
/* r[i][j] -> r[j][i] for 16 vectors of 16 dwords: unpack dwords, then qwords, then 128-bit
 * lanes (b[4i + e]'s lane L holds rows 4i..4i+3 of column 4L + e after the first two). */
static inline __attribute__((always_inline)) void transpose16(__m512i *r) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int e = 0; e < 4; e++) {
        const __m512i c0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x44);
        const __m512i c1 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xEE);
        const __m512i d0 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x44);
        const __m512i d1 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xEE);
        r[e] = _mm512_shuffle_i32x4(c0, d0, 0x88);
        r[4 + e] = _mm512_shuffle_i32x4(c0, d0, 0xDD);
        r[8 + e] = _mm512_shuffle_i32x4(c1, d1, 0x88);
        r[12 + e] = _mm512_shuffle_i32x4(c1, d1, 0xDD);
    }
}

#endif

/* n float32 -> bf16, round_bf16's bits (16 at a time where the build has rne16) */
static inline void round_row(const float *src, uint16_t *dst, long n) {
    long i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), rne16(_mm512_loadu_ps(src + i)));
#endif
    for (; i < n; i++) dst[i] = round_bf16(src[i]);
}

static inline __m512 exp512(__m512 x) {
    /* e^x = 2^n * e^r, r = x - n ln2 in [-ln2/2, ln2/2]; degree-6 polynomial for e^r
     * (relative error ~2e-7, float32 rounding level); x below -87.3 gives 0. */
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
    r = _mm512_fnmadd_ps(n, ln2_lo, r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 16 SiLU-gated activations, bf16(bf16(silu(g)) * u) from bf16 g and u: torch's bf16 silu
 * (rounded once), then its bf16 mul (cpu_moe.c's silu_mul, cpu_amx.c's gated experts) */
static inline __m256i silu_mul16(__m256i g, __m256i u) {
    const __m512 gv = widen16(g);
    const __m512 s = _mm512_div_ps(
        gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    return round16(_mm512_mul_ps(widen16(round16(s)), widen16(u)));
}

/* A weight [n, k] as the matmuls read it: bf16 (scale NULL), or FP8 e4m3 with 128x128 block
 * scales: scale_inv [scale_rows, ceil(k / 128)] float32, row_block[r] the scale row of weight
 * row r (stacked parts each start a new scale row; mci/layers/linear.py). Stacked experts:
 * expert e's weight starts e * n * k elements in and its scales e * scale_rows rows in
 * (`expert_weight`). */
typedef struct {
    const void *data;
    const float *scale;
    const int64_t *row_block;
    long scale_rows;
    int skinny_order; /* FP8 above 16 rows: sum in the skinny kernels' order (cpu_fp8.c) */
    int amx_rows;     /* bf16, k a multiple of 32: calls of this many rows or more on AMX
                       * tiles (cpu_amx.c's mci_amx_rows_range); 0: never */
} Weight;

static inline Weight expert_weight(const Weight *w, long e, long n, long k) {
    Weight r = *w;
    if (w->scale) {
        r.data = (const uint8_t *)w->data + e * n * k;
        r.scale = w->scale + e * w->scale_rows * ((k + 127) / 128);
    } else {
        r.data = (const uint16_t *)w->data + e * n * k;
    }
    return r;
}

/* One weight's rows [n0, n1) for all m rows of x into a sink, bf16 or FP8. cpu_matvec.c. */
void mci_weight_rows(const uint16_t *x, long ldx, const Weight *w, long k, Sink y, long m,
                     long n0, long n1);

/* The same for an FP8 weight. cpu_fp8.c. */
void mci_fp8_rows_range(const uint16_t *x, long ldx, const Weight *w, long k, Sink y, long m,
                        long n0, long n1);

/* Stacked experts into a sink: for each segment s, rows [starts[s], starts[s] + counts[s]) of
 * x go through expert ids[s] (`expert_weight`, an [n, k] weight): on the skinny kernels, or
 * bf16 experts with more than gemm_above rows on mci_bf16_gemm (AVX-512 only; a bound above
 * every count: never). cpu_matvec.c. */
void mci_experts_into(const uint16_t *x, long ldx, const Weight *w, Sink y,
                      const int64_t *ids, const int64_t *starts, const int64_t *counts,
                      long segments, long n, long k, long gemm_above);

/* One weight's rows [n0, n1) (of w [n, k]) for all m rows of x into a sink. cpu_matvec.c. */
void mci_rows_range(const uint16_t *x, long ldx, const uint16_t *w, long k, Sink y, long m,
                    long n0, long n1);

#ifdef __AVX512F__
/* The AVX-512 build's skinny kernel over x already packed, for a caller that runs one x over
 * many weights or strips of one (cpu_fp8.c): mci_packed_size(m, k) elements (a multiple of 32)
 * of 64-byte aligned memory, filled by mci_pack, then mci_packed_rows_range as
 * mci_rows_range. cpu_matvec.c. */
long mci_packed_size(long m, long k);
void mci_pack(const uint16_t *x, long ldx, long m, long k, uint16_t *packed);
void mci_packed_rows_range(const uint16_t *packed, const uint16_t *w, long k, Sink y, long m,
                           long n0, long n1);
#endif

/* The share [n0, n1) of n output features that thread `id` of `count` takes. cpu_matvec.c. */
void mci_share(long n, int id, int count, long *n0, long *n1);

/* RMSNorm rows of float32 or bf16 x into float32 or bf16 y. cpu_matvec.c. */
void mci_add_rms_norm(const float *x, long ldx, const void *a, int a_bf16, float *sum,
                      const uint16_t *w, void *y, int y_bf16, long rows, long n, float eps);
void mci_rms_norm(const void *x, long ldx, int x_bf16, const uint16_t *w, void *y, int y_bf16,
                  long rows, long n, float eps);
/* One row of it, with no parallel region of its own (for callers inside one, or writing a row
 * at a time: an `if (0)` region per row still costs a runtime call). */
void mci_rms_norm_row(const void *x, int x_bf16, const uint16_t *w, void *y, int y_bf16, long n,
                      float eps);

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ w [n, k]^T; bf16 x and y, w bf16
 * or FP8. cpu_matvec.c. */
void mci_linear(const uint16_t *x, long ldx, const Weight *w, uint16_t *y, long ldy, long m,
                long n, long k);

/* The gated MLP: y [m, hidden] bf16 = down(silu(gate) * up) of x bf16. cpu_moe.c. */
void mci_gated_mlp(const uint16_t *x, long ldx, const Weight *w_gate_up, const Weight *w_down,
                   long m, long hidden, long inter, uint16_t *y);

/* The whole MoE block after its router's matmul, into out float32 [t, hidden]; 1 (out
 * untouched) where an expert has more than max_rows tokens in the AVX2 build. cpu_moe.c. */
int mci_moe(const float *x, const float *logits, const float *bias, long t, long e,
            long n_group, long topk_group, long top_k, int norm, float scaling, float *weights,
            int64_t *ids, const Weight *w_gate_up, const Weight *w_down,
            const uint16_t *amx_gate_up, const uint16_t *amx_down, long hidden, long inter,
            const Weight *w_s_gate_up, const Weight *w_s_down, const uint16_t *amx_s_gate_up,
            const uint16_t *amx_s_down, long s_inter, long max_rows, float *out);

/* x + the attention sublayer of a decode step, into out float32 [t, hidden]; -1 where the
 * latent rank is above MAX_LATENT. cpu_mla.c. */
int mci_mla_decode(const float *x, long t, long hidden, const uint16_t *norm_w,
                   float norm_eps, const Weight *w_qkv_a, long q_dim,
                   const uint16_t *q_norm_w, float q_eps, const Weight *w_q_b,
                   long heads, long nope, long r, long c, long v,
                   const uint16_t *kv_norm_w, float kv_eps, const float *cos,
                   const float *sin, int interleave, uint16_t *cache,
                   const int64_t *write_slots, const Weight *w_uk_t,
                   const Weight *w_uv, const int64_t *kv_slots, long ld_slots,
                   const int64_t *lens, float scale, const Weight *w_o, float *out);

/* Where mci_gemm reads a strip of weight rows [s0, s1) as bf16 rows [s1 - s0, k]: a pointer
 * into the weight itself, or `tile` (room for STRIP rows) filled with them. */
typedef struct GemmRows {
    const uint16_t *(*strip)(const struct GemmRows *self, long s0, long s1, uint16_t *tile);
} GemmRows;

/* Rows [n0, n1) of a weight for all m rows of x into a sink, as a GEMM (many rows; sums in
 * column-pair order). cpu_gemm.c, AVX-512 only. */
void mci_gemm(const uint16_t *x, long ldx, long k, Sink y, long m, long n0, long n1,
              const GemmRows *rows);

/* The same over a bf16 weight w [n, k]. cpu_gemm.c (the AVX2 library's stub aborts). */
void mci_bf16_gemm(const uint16_t *x, long ldx, const uint16_t *w, long k, Sink y, long m,
                   long n0, long n1);

/* Routed experts on AMX tiles (cpu_amx.c): as mci_experts_into, with the weights packed by
 * mci_amx_pack; n and k multiples of 32. */
void mci_amx_experts_into(const uint16_t *x, long ldx, const uint16_t *packed, Sink y,
                          const int64_t *ids, const int64_t *starts, const int64_t *counts,
                          long segments, long n, long k);

/* x [m, k] (row stride ldx) through one packed weight [1, n, k] (mci_amx_pack) into the sink:
 * mci_amx_experts_into's sums for one segment of every row (with `gated`, a gate_up weight
 * packed interleaved: mci_amx_gated_experts_into's activations), the threads splitting the
 * rows (cpu_amx.c): a weighted-sum sink must give every row its own token. n and k multiples
 * of 32. */
void mci_amx_packed_linear(const uint16_t *x, long ldx, const uint16_t *packed, Sink y, long m,
                           long n, long k, int gated);

/* The same for a gate_up weight [experts, 2 inter, k] packed with its gate and up rows
 * interleaved 16 at a time (gate rows 16 j.., then up rows 16 j.., for each j), into y's bf16
 * rows [*, inter] as their SiLU-gated activations (silu_mul16), n = 2 inter. cpu_amx.c. */
void mci_amx_gated_experts_into(const uint16_t *x, long ldx, const uint16_t *packed, Sink y,
                                const int64_t *ids, const int64_t *starts,
                                const int64_t *counts, long segments, long n, long k);

/* Rows [n0, n1) of a bf16 weight w [n, k], read in place, for all m rows of x into a sink, on
 * AMX tiles (cpu_amx.c); k a multiple of 32. Called by each thread for its own share. */
void mci_amx_rows_range(const uint16_t *x, long ldx, const uint16_t *w, long k, Sink y, long m,
                        long n0, long n1);

/* Cascade attention's merge of two partial results by their softmax masses
 * (cpu_prefill_attention.c): out [n, heads, dv] bf16, torch's roundings. */
void mci_merge_partials(const uint16_t *first, long f_ldh, long f_ldn, const uint16_t *second,
                        long s_ldb, long s_ldh, long s_ldq, long q_len, const float *wf,
                        const float *ws, long n, long heads, long dv, uint16_t *out);

/* A row's softmax (cpu_prefill_attention.c): s, its scaled float32 scores (overwritten with
 * their exps), over its first `limit`, mx their maximum -> p [lp] (lp a multiple of 16, >=
 * limit) rounded once to bf16, zero past the limit, and lse (-inf for an empty row). */
void mci_softmax_probs(float *s, long limit, float mx, long lp, uint16_t *p, float *lse);

/* Prefill attention's scores on AMX tiles (cpu_amx.c): 32 query rows q [32, d] (row stride
 * ldq; all 32 readable) against nkb blocks of 16 packed keys (cpu_prefill_attention.c's
 * layout) -> s [32][16 nkb] float32 (row stride lds), times scale, and mx [32]: each row's
 * maximum over its first limits[r] (<= 16 nkb) scores; d a multiple of 32. Rows past the last
 * with limits[r] > 0 hold no defined scores (left unscaled, or unwritten from 16 on), and
 * their mx is -inf. */
void mci_amx_scores(const uint16_t *q, long ldq, long d, const uint16_t *kp, long nkb,
                    float scale, float *s, long lds, const long *limits, float *mx);

/* Prefill attention's P [32, 32 nkc] (bf16, row stride ldp) times its values packed in lc
 * chunks of 32 keys (cpu_prefill_attention.c's mci_pack_values) on AMX tiles (cpu_amx.c) ->
 * the first `rows` rows of out [32, dv] (bf16, row stride ld_out); dv a multiple of 32. */
void mci_amx_pv(const uint16_t *p, long ldp, const uint16_t *vp, long lc, long nkc, long dv,
                int rows, uint16_t *out, long ld_out);

#endif
