/* The AVX-512 intrinsics the bf16 kernels use, for a CPU with AVX2 and FMA only (build.py's
 * second library; cpu_kernels.h includes this where __AVX512F__ is not defined).
 *
 * Why: on an x86 CPU without AVX-512 (an AVX2 EPYC of Zen 2/3, most laptops) neither these
 * kernels nor oneDNN's bf16 matmuls ran, and a decode step fell back to ~800 small torch ops
 * and torch's own bf16 matmuls (the `small` model's single-stream step: ~22 ms against a
 * ~1.7 ms memory floor). Rather than a second copy of every kernel, each 512-bit operation
 * they use is written here as two 256-bit halves, under the intrinsic's own name (a macro),
 * so cpu_matvec.c, cpu_mla.c, cpu_moe.c and cpu_prefill_attention.c compile unchanged.
 * FP8 (AVX512-VBMI) and AMX stay AVX-512 only: their files build as stubs here.
 *
 * What each stand-in computes (float32 lanes 0-7 are the low half, 8-15 the high half):
 * - _mm512_dpbf16_ps: per lane, acc += odd pair's product, then acc += even pair's product,
 *   each an FMA on exact bf16 products (the order of the Intel SDM's VDPBF16PS pseudo-code).
 *   The instruction also treats bf16 denormal inputs as zero; these do not. A sum can
 *   therefore differ from an AVX-512 CPU's in its last float32 bit only where an input is
 *   a bf16 denormal (below ~1.2e-38); it is the same exact-product, float32-sum, round-once
 *   result either way.
 * - _mm512_reduce_add_ps: GCC's own order (halves, quarters, then pairs).
 * - _mm512_cvtneps_pbh: round to nearest even, float32 denormals flushed to zero, NaN kept
 *   quiet, as the instruction does (cpu_kernels.h's round_bf16 for every other value).
 * - _mm512_scalef_ps (exp512's last step, n integral): p * 2^n as two exact power-of-two
 *   products, so overflow is inf and one rounding at most, as scalef.
 * - masked loads and stores touch only the lanes their mask selects (AVX's maskload and
 *   maskstore, or a scalar loop for 16-bit lanes).
 */
#ifndef MCI_CPU_AVX2_H
#define MCI_CPU_AVX2_H

#include <immintrin.h>
#include <stdint.h>

/* 512-bit values as two 256-bit halves. The hot loops (cpu_matvec.c's matmul, cpu_mla.c's
 * attention) have AVX2 code of their own: GCC keeps a 512-bit vector in memory on an AVX2
 * target, so these stand-ins suit only the kernels' smaller steps. */
typedef union {
    __m512 z;
    __m256 y[2];
} mci_ps512;

typedef union {
    __m512i z;
    __m256i y[2];
    uint16_t u16[32];
} mci_si512;

static inline __m512 mci_ps(__m256 lo, __m256 hi) {
    mci_ps512 u;
    u.y[0] = lo;
    u.y[1] = hi;
    return u.z;
}

static inline __m512i mci_si(__m256i lo, __m256i hi) {
    mci_si512 u;
    u.y[0] = lo;
    u.y[1] = hi;
    return u.z;
}

static inline __m256 mci_lo(__m512 v) { return ((mci_ps512){.z = v}).y[0]; }
static inline __m256 mci_hi(__m512 v) { return ((mci_ps512){.z = v}).y[1]; }
static inline __m256i mci_loi(__m512i v) { return ((mci_si512){.z = v}).y[0]; }
static inline __m256i mci_hii(__m512i v) { return ((mci_si512){.z = v}).y[1]; }

/* lanes of a 16-lane float32 mask as two all-ones/zero 8-lane masks */
static inline __m256i mci_mask8(unsigned bits) {
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), lane), lane);
}

#define MCI_PS_OP2(name, op256)                                                     \
    static inline __m512 name(__m512 a, __m512 b) {                                 \
        return mci_ps(op256(mci_lo(a), mci_lo(b)), op256(mci_hi(a), mci_hi(b)));    \
    }
MCI_PS_OP2(mci_add_ps, _mm256_add_ps)
MCI_PS_OP2(mci_sub_ps, _mm256_sub_ps)
MCI_PS_OP2(mci_mul_ps, _mm256_mul_ps)
MCI_PS_OP2(mci_div_ps, _mm256_div_ps)
MCI_PS_OP2(mci_max_ps, _mm256_max_ps)

static inline __m512 mci_fmadd_ps(__m512 a, __m512 b, __m512 c) {
    return mci_ps(_mm256_fmadd_ps(mci_lo(a), mci_lo(b), mci_lo(c)),
                  _mm256_fmadd_ps(mci_hi(a), mci_hi(b), mci_hi(c)));
}

static inline __m512 mci_fnmadd_ps(__m512 a, __m512 b, __m512 c) {
    return mci_ps(_mm256_fnmadd_ps(mci_lo(a), mci_lo(b), mci_lo(c)),
                  _mm256_fnmadd_ps(mci_hi(a), mci_hi(b), mci_hi(c)));
}

static inline __m512 mci_setzero_ps(void) {
    return mci_ps(_mm256_setzero_ps(), _mm256_setzero_ps());
}

static inline __m512 mci_set1_ps(float f) { return mci_ps(_mm256_set1_ps(f), _mm256_set1_ps(f)); }

static inline __m512i mci_set1_epi32(int i) {
    return mci_si(_mm256_set1_epi32(i), _mm256_set1_epi32(i));
}

static inline __m512 mci_loadu_ps(const void *p) {
    return mci_ps(_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8));
}

static inline void mci_storeu_ps(void *p, __m512 v) {
    _mm256_storeu_ps((float *)p, mci_lo(v));
    _mm256_storeu_ps((float *)p + 8, mci_hi(v));
}

static inline __m512i mci_loadu_si512(const void *p) {
    return mci_si(_mm256_loadu_si256((const __m256i *)p),
                  _mm256_loadu_si256((const __m256i *)p + 1));
}

static inline __m512 mci_maskz_loadu_ps(__mmask16 m, const void *p) {
    return mci_ps(_mm256_maskload_ps((const float *)p, mci_mask8(m)),
                  _mm256_maskload_ps((const float *)p + 8, mci_mask8(m >> 8)));
}

static inline void mci_mask_storeu_ps(void *p, __mmask16 m, __m512 v) {
    _mm256_maskstore_ps((float *)p, mci_mask8(m), mci_lo(v));
    _mm256_maskstore_ps((float *)p + 8, mci_mask8(m >> 8), mci_hi(v));
}

static inline __m512 mci_maskz_mov_ps(__mmask16 m, __m512 v) {
    return mci_ps(_mm256_and_ps(_mm256_castsi256_ps(mci_mask8(m)), mci_lo(v)),
                  _mm256_and_ps(_mm256_castsi256_ps(mci_mask8(m >> 8)), mci_hi(v)));
}

/* 16-bit lanes: masks are the kernels' tails, so a scalar loop over the selected lanes */
static inline __m512i mci_maskz_loadu_epi16(__mmask32 m, const void *p) {
    mci_si512 u = {.y = {_mm256_setzero_si256(), _mm256_setzero_si256()}};
    for (int i = 0; i < 32; i++)
        if ((m >> i) & 1) u.u16[i] = ((const uint16_t *)p)[i];
    return u.z;
}

static inline __m256i mci_maskz_loadu_epi16_256(__mmask16 m, const void *p) {
    mci_si512 u = {.y = {_mm256_setzero_si256(), _mm256_setzero_si256()}};
    for (int i = 0; i < 16; i++)
        if ((m >> i) & 1) u.u16[i] = ((const uint16_t *)p)[i];
    return u.y[0];
}

static inline void mci_mask_storeu_epi16_256(void *p, __mmask16 m, __m256i v) {
    mci_si512 u;
    u.y[0] = v;
    for (int i = 0; i < 16; i++)
        if ((m >> i) & 1) ((uint16_t *)p)[i] = u.u16[i];
}

static inline __m512 mci_castsi512_ps(__m512i v) {
    return mci_ps(_mm256_castsi256_ps(mci_loi(v)), _mm256_castsi256_ps(mci_hii(v)));
}

static inline __m512i mci_slli_epi32(__m512i v, unsigned n) {
    return mci_si(_mm256_slli_epi32(mci_loi(v), (int)n), _mm256_slli_epi32(mci_hii(v), (int)n));
}

static inline __m512i mci_cvtepu16_epi32(__m256i v) {
    return mci_si(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)),
                  _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)));
}

/* 16 bf16 as float32: the odd elements (1, 3, .., 15) and the even ones (0, 2, .., 14) */
static inline __m256 mci_odd8(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}
static inline __m256 mci_even8(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }

/* acc += a.odd * b.odd, then acc += a.even * b.even, per float32 lane (see the top) */
static inline __m256 mci_dpbf16_256(__m256 acc, __m256i a, __m256i b) {
    acc = _mm256_fmadd_ps(mci_odd8(a), mci_odd8(b), acc);
    return _mm256_fmadd_ps(mci_even8(a), mci_even8(b), acc);
}

/* m rows of x (k bf16 each, row stride ldx) widened once, per 32-element chunk as the dot
 * product above pairs them: the low half's odd and even elements, then the high half's
 * (4 x 8 float32, zeros past k), at out[(row * chunks + chunk) * 32]. The native AVX2 loops
 * (cpu_matvec.c's matmul, cpu_mla.c's attention) read x this way. */
static inline void mci_widen_rows(const uint16_t *x, long ldx, long m, long k, float *out) {
    const long chunks = (k + 31) / 32;
    for (long j = 0; j < m; j++)
        for (long c = 0; c < chunks; c++) {
            uint16_t part[32] = {0};
            const long n = k - c * 32 < 32 ? k - c * 32 : 32;
            __builtin_memcpy(part, x + j * ldx + c * 32, n * sizeof(uint16_t));
            const __m256i lo = _mm256_loadu_si256((const __m256i *)part);
            const __m256i hi = _mm256_loadu_si256((const __m256i *)(part + 16));
            float *o = out + (j * chunks + c) * 32;
            _mm256_storeu_ps(o, mci_odd8(lo));
            _mm256_storeu_ps(o + 8, mci_even8(lo));
            _mm256_storeu_ps(o + 16, mci_odd8(hi));
            _mm256_storeu_ps(o + 24, mci_even8(hi));
        }
}

static inline __m512 mci_dpbf16_ps(__m512 acc, __m512bh a, __m512bh b) {
    const __m512i ai = (__m512i)a, bi = (__m512i)b;
    return mci_ps(mci_dpbf16_256(mci_lo(acc), mci_loi(ai), mci_loi(bi)),
                  mci_dpbf16_256(mci_hi(acc), mci_hii(ai), mci_hii(bi)));
}

/* the sum of 16 float32 lanes held as two halves, in _mm512_reduce_add_ps's order */
static inline float mci_reduce_halves(__m256 lo, __m256 hi) {
    const __m256 t3 = _mm256_add_ps(hi, lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return t8[0] + t8[1];
}

static inline float mci_reduce_add_ps(__m512 v) { return mci_reduce_halves(mci_lo(v), mci_hi(v)); }

/* the largest of 16 float32 lanes (exact in any order; callers keep NaN out of the lanes) */
static inline float mci_reduce_max_ps(__m512 v) {
    const __m256 t = _mm256_max_ps(mci_lo(v), mci_hi(v));
    __m128 q = _mm_max_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    q = _mm_max_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
    return q[0] > q[1] ? q[0] : q[1];
}

/* 8 float32 -> 8 bf16 in the low 16 bits of each 32-bit lane */
static inline __m256i mci_round8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i exp_zero =
        _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7f800000)), _mm256_setzero_si256());
    const __m256i flushed = _mm256_blendv_epi8(u, _mm256_and_si256(u, _mm256_set1_epi32((int)0x80000000u)), exp_zero);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(flushed, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(flushed, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, nan);
}

/* 16 float32 -> 16 bf16, as a __m256i */
static inline __m256i mci_cvtneps_pbh(__m512 v) {
    const __m256i packed = _mm256_packus_epi32(mci_round8(mci_lo(v)), mci_round8(mci_hi(v)));
    return _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0));
}

static inline __m512 mci_roundscale_nearest_ps(__m512 v) {
    return mci_ps(_mm256_round_ps(mci_lo(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                  _mm256_round_ps(mci_hi(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

static inline __m256 mci_scalef_256(__m256 p, __m256 n) {
    __m256i ni = _mm256_cvtps_epi32(n);
    ni = _mm256_min_epi32(_mm256_max_epi32(ni, _mm256_set1_epi32(-252)), _mm256_set1_epi32(254));
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

/* cpu_kernels.h's exp512 on 8 lanes: the same operations, so the same values lane for lane */
static inline __m256 mci_exp256(__m256 x) {
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n =
        _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, ln2_hi, x);
    r = _mm256_fnmadd_ps(n, ln2_lo, r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    return mci_scalef_256(p, n);
}

static inline __m512 mci_scalef_ps(__m512 p, __m512 n) {
    return mci_ps(mci_scalef_256(mci_lo(p), mci_lo(n)), mci_scalef_256(mci_hi(p), mci_hi(n)));
}

#define _mm512_add_ps mci_add_ps
#define _mm512_sub_ps mci_sub_ps
#define _mm512_mul_ps mci_mul_ps
#define _mm512_div_ps mci_div_ps
#define _mm512_max_ps mci_max_ps
#define _mm512_fmadd_ps mci_fmadd_ps
#define _mm512_fnmadd_ps mci_fnmadd_ps
#define _mm512_setzero_ps mci_setzero_ps
#define _mm512_set1_ps mci_set1_ps
#define _mm512_set1_epi32 mci_set1_epi32
#define _mm512_loadu_ps mci_loadu_ps
#define _mm512_load_ps mci_loadu_ps
#define _mm512_storeu_ps mci_storeu_ps
#define _mm512_store_ps mci_storeu_ps
#define _mm512_loadu_si512 mci_loadu_si512
#define _mm512_maskz_loadu_ps mci_maskz_loadu_ps
#define _mm512_mask_storeu_ps mci_mask_storeu_ps
#define _mm512_maskz_mov_ps mci_maskz_mov_ps
#define _mm512_maskz_loadu_epi16 mci_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 mci_maskz_loadu_epi16_256
#define _mm256_mask_storeu_epi16 mci_mask_storeu_epi16_256
#define _mm512_castsi512_ps mci_castsi512_ps
#define _mm512_slli_epi32 mci_slli_epi32
#define _mm512_cvtepu16_epi32 mci_cvtepu16_epi32
#define _mm512_dpbf16_ps mci_dpbf16_ps
#define _mm512_reduce_add_ps mci_reduce_add_ps
#define _mm512_reduce_max_ps mci_reduce_max_ps
#define _mm512_cvtneps_pbh mci_cvtneps_pbh
#define _mm512_scalef_ps mci_scalef_ps
/* exp512 only rounds to nearest */
#define _mm512_roundscale_ps(v, mode) mci_roundscale_nearest_ps(v)

#endif
