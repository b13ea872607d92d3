/* Multi-head latent attention (MLA) at decode sizes on the CPU: attention over latent rows
 * read in place through slot indices, the rotary embedding, the latent cache write, and the
 * whole attention sublayer of a decode step in one call (mci/layers/attention.py's absorbed
 * path with the kernels, step by step: the same functions, so the same bits). */
#include <string.h>

#include "cpu_kernels.h"

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
#define AMX_HEADS 32 /* on AMX, a work item's heads: mci_amx_scores' block of query rows */

#ifdef __AVX512F__
#define HEAD_BLOCK 8   /* heads whose values share one pass over the key rows (pass 2) */
#define KEY_BLOCK 256  /* keys whose rows every head reads while they are in L2 */
#define SCORE_GROUP 4  /* pass 1: heads, and keys, whose 16 scores share each chunk's loads */

/* Pass 2 for NH heads (scores p [NH][len], running sums run [NH][cw]) over keys [b0, b1): 32
 * latent columns at a time, the heads' sums in registers across the keys. */
static inline __attribute__((always_inline)) void values_block(
    const float *p, long len, const uint16_t *cache, const int64_t *slots, long d, long c,
    long cw, float *run, const int NH, long b0, long b1) {
    for (long j = 0; j < c; j += 32) {
        const __mmask16 m0 = c - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (c - j)) - 1);
        const __mmask16 m1 = c - j >= 32   ? (__mmask16)0xffff
                             : c - j > 16 ? (__mmask16)((1u << (c - j - 16)) - 1)
                                          : 0;
        __m512 a0[HEAD_BLOCK], a1[HEAD_BLOCK];
        for (int hh = 0; hh < NH; hh++) {
            a0[hh] = _mm512_load_ps(run + hh * cw + j);
            a1[hh] = _mm512_load_ps(run + hh * cw + j + 16);
        }
        for (long l = b0; l < b1; l++) {
            const uint16_t *row = cache + slots[l] * d + j;
            const __m512 v0 = widen16(_mm256_maskz_loadu_epi16(m0, row));
            const __m512 v1 = widen16(_mm256_maskz_loadu_epi16(m1, row + 16));
            for (int hh = 0; hh < NH; hh++) {
                const __m512 ph = _mm512_set1_ps(p[hh * len + l]);
                a0[hh] = _mm512_fmadd_ps(ph, v0, a0[hh]);
                a1[hh] = _mm512_fmadd_ps(ph, v1, a1[hh]);
            }
        }
        for (int hh = 0; hh < NH; hh++) {
            _mm512_store_ps(run + hh * cw + j, a0[hh]);
            _mm512_store_ps(run + hh * cw + j + 16, a1[hh]);
        }
    }
}

/* Each (key, head) score is the 16-lane dot product, chunk by chunk, reduced as
 * _mm512_reduce_add_ps does; each output element's sum adds p[l] * row[l] in the order of l.
 * Both passes keep their accumulators in registers: pass 1 reduces the scores of 4 heads x 4
 * keys at once (reduce16: the same lane pairs for each of its 16 sums, so a score's bits do
 * not depend on its slot), pass 2 accumulates 8 heads x 32 latent columns over a block of keys
 * before storing them (and takes them up again at the next block: the same chain of
 * multiply-adds). Keys go in blocks of KEY_BLOCK, so each pass reads a key row from DRAM or
 * L3 once however many heads and columns revisit it.
 * Measured against pass 1 by 16 keys of one head and the scalar maximum (old and new
 * libraries alternating in one process on a 2-core Zen 4 EPYC; outputs bit-equal over 300
 * random shapes with NaN, +-inf and -0 in the cache): 8 heads, d 160, c 128 (`small`), 32
 * sequences of 192 keys 227 -> 163 us, one of 8,192 keys 292 -> 228 us. */
static void attend_one(const uint16_t *q, long d, const uint16_t *cache, const int64_t *slots,
                       long len, long c, float scale, uint16_t *out, int heads, float *scores) {
    const long d_full = d & ~31L;
    const __mmask32 d_tail = (__mmask32)((1ULL << (d - d_full)) - 1);
    /* pass 1: scores [heads][len], block by block of keys, 4 heads x 4 keys at a time: each
     * 32-column chunk of 4 key rows and 4 queries is loaded once for 16 dot products (16
     * keys of one head at a time loaded a chunk per product, and spilled registers) */
    const __m512i lane_of = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (long b0 = 0; b0 < len; b0 += KEY_BLOCK) {
        const long b1 = b0 + KEY_BLOCK < len ? b0 + KEY_BLOCK : len;
        for (int h0 = 0; h0 < heads; h0 += SCORE_GROUP) {
            const int nh = heads - h0 < SCORE_GROUP ? heads - h0 : SCORE_GROUP;
            /* heads past the item's repeat its first (their sums are not stored) */
            const uint16_t *qs[SCORE_GROUP];
            for (int i = 0; i < SCORE_GROUP; i++) qs[i] = q + (h0 + (i < nh ? i : 0)) * d;
            for (long l0 = b0; l0 < b1; l0 += SCORE_GROUP) {
                const int keys = b1 - l0 < SCORE_GROUP ? (int)(b1 - l0) : SCORE_GROUP;
                const uint16_t *rows[SCORE_GROUP]; /* keys past the block repeat its first */
                for (int b = 0; b < SCORE_GROUP; b++)
                    rows[b] = cache + slots[l0 + (b < keys ? b : 0)] * d;
                __m512 acc[16]; /* acc[SCORE_GROUP * i + b]: head h0 + i, key l0 + b */
                _Pragma("GCC unroll 16") for (int a = 0; a < 16; a++) acc[a] = _mm512_setzero_ps();
                for (long kk = 0; kk < d_full; kk += 32) {
                    __m512i kv[SCORE_GROUP], qv[SCORE_GROUP];
                    _Pragma("GCC unroll 4") for (int b = 0; b < SCORE_GROUP; b++) {
                        kv[b] = _mm512_loadu_si512(rows[b] + kk);
                        qv[b] = _mm512_loadu_si512(qs[b] + kk);
                    }
                    _Pragma("GCC unroll 16") for (int a = 0; a < 16; a++) acc[a] =
                        _mm512_dpbf16_ps(acc[a], (__m512bh)kv[a % SCORE_GROUP],
                                         (__m512bh)qv[a / SCORE_GROUP]);
                }
                if (d_tail) {
                    __m512i kv[SCORE_GROUP], qv[SCORE_GROUP];
                    _Pragma("GCC unroll 4") for (int b = 0; b < SCORE_GROUP; b++) {
                        kv[b] = _mm512_maskz_loadu_epi16(d_tail, rows[b] + d_full);
                        qv[b] = _mm512_maskz_loadu_epi16(d_tail, qs[b] + d_full);
                    }
                    _Pragma("GCC unroll 16") for (int a = 0; a < 16; a++) acc[a] =
                        _mm512_dpbf16_ps(acc[a], (__m512bh)kv[a % SCORE_GROUP],
                                         (__m512bh)qv[a / SCORE_GROUP]);
                }
                /* acc[a]'s sum is in lane 4 (a % 4) + a / 4 of reduce16's result */
                float sums[16];
                _mm512_storeu_ps(sums, _mm512_mul_ps(_mm512_permutexvar_ps(lane_of, reduce16(acc)),
                                                     vscale));
                for (int i = 0; i < nh; i++)
                    for (int b = 0; b < keys; b++)
                        scores[(h0 + i) * len + l0 + b] = sums[SCORE_GROUP * i + b];
            }
        }
    }
    /* softmax per head, in place; the sum kept for the end */
    float total[MAX_HEADS_PER_ITEM];
    for (int h = 0; h < heads; h++) {
        float *s = scores + h * len;
        /* over 16 lanes, then across them: max is exact, and a NaN score is skipped either
         * way, so mx is the plain loop's */
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        long l = 0;
        for (; l + 16 <= len; l += 16) vmax = _mm512_max_ps(_mm512_loadu_ps(s + l), vmax);
        float mx = _mm512_reduce_max_ps(vmax);
        for (; l < len; l++) mx = s[l] > mx ? s[l] : mx;
        const __m512 vmx = _mm512_set1_ps(mx);
        __m512 vsum = _mm512_setzero_ps();
        l = 0;
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
    /* pass 2: out[h] = sum_l p[h][l] * row[:c] / total[h], rounded once to bf16; the running
     * sums of a block of keys wait in acc (L1/L2) for the next block */
    const long cw = (c + 31) & ~31L; /* acc's row: whole 32-column blocks */
    float *acc = aligned_alloc(64, sizeof(float) * heads * cw);
    memset(acc, 0, sizeof(float) * heads * cw);
    for (long b0 = 0; b0 < len; b0 += KEY_BLOCK) {
        const long b1 = b0 + KEY_BLOCK < len ? b0 + KEY_BLOCK : len;
        for (int h0 = 0; h0 < heads; h0 += HEAD_BLOCK) {
            const float *p = scores + h0 * len;
            float *run = acc + h0 * cw;
            switch (heads - h0 < HEAD_BLOCK ? heads - h0 : HEAD_BLOCK) {
            case 1: values_block(p, len, cache, slots, d, c, cw, run, 1, b0, b1); break;
            case 2: values_block(p, len, cache, slots, d, c, cw, run, 2, b0, b1); break;
            case 3: values_block(p, len, cache, slots, d, c, cw, run, 3, b0, b1); break;
            case 4: values_block(p, len, cache, slots, d, c, cw, run, 4, b0, b1); break;
            case 5: values_block(p, len, cache, slots, d, c, cw, run, 5, b0, b1); break;
            case 6: values_block(p, len, cache, slots, d, c, cw, run, 6, b0, b1); break;
            case 7: values_block(p, len, cache, slots, d, c, cw, run, 7, b0, b1); break;
            default: values_block(p, len, cache, slots, d, c, cw, run, 8, b0, b1); break;
            }
        }
    }
    for (int h = 0; h < heads; h++) {
        const float inv = 1.0f / total[h];
        for (long j = 0; j < c; j++) out[h * c + j] = round_bf16(acc[h * cw + j] * inv);
    }
    free(acc);
}

/* ---- The same attention on AMX tiles (a CPU with AMX-BF16) ---------------------------------
 * Why: on a 2-core Xeon with AMX-BF16 the passes above took 14% of the samples (perf) of a
 * 32-request decode step of `small` at 128-256 tokens of context. Here a work item's heads
 * are the query rows of prefill attention's AMX kernels (cpu_amx.c's mci_amx_scores and
 * mci_amx_pv, cpu_prefill_attention.c's softmax), and its latent rows, read through the
 * slots, are packed into their B layouts a few at a time, so the packs stay in L1/L2:
 *   scores: AMX_KEYS keys at a time, each block of 16 keys transposed as 16 x 16 pairs;
 *   P V:    32 value columns at a time over every key, pairs of keys interleaved.
 * Measured (the two paths alternating in one process): 32 sequences of 192 keys, 8 heads,
 * 87-90 -> 75-77 us a layer with the rows in cache; the 32-request step of `small` 17.2-18.0
 * -> 15.3-17.4 ms (alternating processes, 3 of each, on a busy host). What is left is mostly
 * the wait for the rows themselves: a sequence's decoded rows are scattered over the pool.
 * What differs from the passes above (the bound, tests/test_cpu_kernels.py): each score is a
 * float32 sum in AMX's order; P is normalised and rounded once to bf16 before P V (as the
 * prefill kernels and the reference's eager attention do), where the passes above keep it in
 * float32 and divide at the end; P V's sums are AMX's order. A sequence's result still
 * depends only on its own query, rows and length, whatever the other sequences or the
 * threads: which sequences run on AMX is decided by their own lengths alone. A work item of 16
 * heads or fewer leaves the tiles' second 16 rows out (mci_amx_scores, mci_amx_pv): 32
 * sequences of 192 keys, 8 heads, 141 -> 113 us a layer. */
#define AMX_KEYS 256 /* keys packed at a time for the scores (80 KB at d = 160) */
/* the longest context on AMX: a thread's scores, P and packed values for 32 heads then take
 * ~1.1 MB, inside this Xeon's 2 MB of L2 (at 8,192 keys they spilled, and 2 sequences took
 * 1.2 ms a layer against the passes above's 0.47) */
#define AMX_MAX_KEYS 4096
/* a work item alone in its call: split over the threads from this many keys; below, the
 * threads' start and barriers cost more than they save (8 heads of `small`, 2 threads: 288
 * keys 17.9 us on one thread, 18.6 split; 1,024 keys 45.0 and 36.9) */
#define SPLIT_MIN_KEYS 512

/* Keys [0, n) through their slots -> kp [ceil(n / 16)][d / 2][16][2] (mci_amx_scores' B
 * operand: block kb's pair-row t holds dims 2t, 2t + 1 of its 16 keys), keys past n zero. */
static void pack_slot_keys(const uint16_t *cache, const int64_t *slots, long n, long d,
                           uint16_t *kp) {
    for (long kb = 0; kb * 16 < n; kb++) {
        const uint16_t *rows[16];
        for (int j = 0; j < 16; j++) rows[j] = kb * 16 + j < n ? cache + slots[kb * 16 + j] * d : 0;
        /* the next block's rows on their way while this one is transposed: the rows sit where
         * the slots put them, so the hardware prefetchers do not see them coming */
        for (long l = (kb + 1) * 16; l < (kb + 2) * 16 && l < n; l++)
            for (long e = 0; e < d; e += 32)
                _mm_prefetch((const char *)(cache + slots[l] * d + e), _MM_HINT_T0);
        for (long t = 0; t < d / 32; t++) {
            __m512i r[16];
            for (int j = 0; j < 16; j++)
                r[j] = rows[j] ? _mm512_loadu_si512(rows[j] + 32 * t) : _mm512_setzero_si512();
            transpose16(r); /* r[p] lane j: key j's pair 16 t + p */
            uint16_t *dst = kp + (kb * (d / 2) + 16 * t) * 32;
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(dst + p * 32, r[p]);
        }
    }
}

/* Value columns [c0, c0 + 32) of keys [0, n) through their slots -> vp [2][lc][16][16][2]
 * (mci_amx_pv's B operand for those 32 columns: vp[ct][kc][p][j][i] = value column
 * c0 + 16 ct + j of key 32 kc + 2 p + i), keys past n zero. */
static void pack_slot_values(const uint16_t *cache, const int64_t *slots, long n, long d,
                             long c0, long lc, uint16_t *vp) {
    __m512i lo, hi; /* a's column j to lane 2 j, b's to lane 2 j + 1: the first 16, the last */
    uint16_t idx[64];
    for (int j = 0; j < 16; j++) {
        idx[2 * j] = j, idx[2 * j + 1] = 32 + j;
        idx[32 + 2 * j] = 16 + j, idx[32 + 2 * j + 1] = 48 + j;
    }
    lo = _mm512_loadu_si512(idx);
    hi = _mm512_loadu_si512(idx + 32);
    for (long kc = 0; kc < lc; kc++)
        for (int p = 0; p < 16; p++) {
            const long l = kc * 32 + 2 * p;
            const __m512i a = l < n ? _mm512_loadu_si512(cache + slots[l] * d + c0)
                                    : _mm512_setzero_si512();
            const __m512i b = l + 1 < n ? _mm512_loadu_si512(cache + slots[l + 1] * d + c0)
                                        : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + kc * 512 + p * 32, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(vp + (lc + kc) * 512 + p * 32,
                                _mm512_permutex2var_epi16(a, hi, b));
        }
}

/* A thread's room for amx_attend_one, or a call's for amx_attend_split (a kp and a vp per
 * thread: `packs`), for contexts of up to max_len keys. */
typedef struct {
    uint16_t *q;  /* [AMX_HEADS][d]: the item's heads, zero below */
    float *s;     /* [AMX_HEADS][lds] scores */
    uint16_t *p;  /* [AMX_HEADS][width] probabilities */
    uint16_t *kp; /* [packs][AMX_KEYS * d] packed keys */
    uint16_t *vp; /* [packs][lc * 1024]: 32 value columns of every key, packed */
    long lds, width, lc;
} AmxRoom;

static AmxRoom amx_room(long max_len, long d, int packs) {
    AmxRoom w;
    const long lc = (max_len + 31) / 32;
    /* row strides 64 bytes past the keys' (cpu_prefill_attention.c: not all in one L1 set) */
    w.lds = lc * 32 + 16;
    w.width = lc * 32 + 32;
    w.q = aligned_alloc(64, sizeof(uint16_t) * AMX_HEADS * d);
    w.s = aligned_alloc(64, sizeof(float) * AMX_HEADS * w.lds);
    w.p = calloc((size_t)AMX_HEADS * w.width, sizeof(uint16_t)); /* rows never written: 0 */
    w.lc = lc;
    w.kp = aligned_alloc(64, sizeof(uint16_t) * AMX_KEYS * d * packs);
    w.vp = aligned_alloc(64, sizeof(uint16_t) * lc * 1024 * packs);
    return w;
}

static void amx_room_free(AmxRoom *w) {
    free(w->q), free(w->s), free(w->p), free(w->kp), free(w->vp);
}

/* The steps of a work item on AMX, shared by amx_attend_one and amx_attend_split: each
 * writes its own part of the room, so the two compute the same sums whichever thread runs a
 * step. heads <= AMX_HEADS, d and c multiples of 32. */
static void amx_take_queries(AmxRoom *w, const uint16_t *q, int heads, long d) {
    memcpy(w->q, q, sizeof(uint16_t) * heads * d);
    memset(w->q + heads * d, 0, sizeof(uint16_t) * (AMX_HEADS - heads) * d);
}

/* Scores of keys [k0, k0 + n) (n <= AMX_KEYS; k0 a multiple of 32, so no tile store reaches
 * another call's keys) into w->s, packed through kp; each row's maximum over them -> part. */
static void amx_scores_keys(AmxRoom *w, uint16_t *kp, const uint16_t *cache,
                            const int64_t *slots, long k0, long n, long d, int heads,
                            float scale, float *part) {
    long limit[AMX_HEADS];
    for (int h = 0; h < AMX_HEADS; h++) limit[h] = h < heads ? n : 0;
    pack_slot_keys(cache, slots + k0, n, d, kp);
    mci_amx_scores(w->q, d, d, kp, (n + 15) / 16, scale, w->s + k0, w->lds, limit, part);
}

/* Head h's probabilities over its len scores, mx their maximum, into w->p. */
static void amx_probs(AmxRoom *w, int h, long len, float mx) {
    float lse;
    mci_softmax_probs(w->s + h * w->lds, len, mx, (len + 31) / 32 * 32, w->p + h * w->width,
                      &lse);
}

/* Value columns [c0, c0 + 32) of every head's output, packed through vp. */
static void amx_values_tile(AmxRoom *w, uint16_t *vp, const uint16_t *cache,
                            const int64_t *slots, long len, long d, long c0, int heads,
                            uint16_t *out, long c) {
    const long lc = (len + 31) / 32;
    pack_slot_values(cache, slots, len, d, c0, lc, vp);
    mci_amx_pv(w->p, w->width, vp, lc, lc, 32, heads, out + c0, c);
}

/* attend_one's result on AMX tiles (the bound above), on the calling thread. */
static void amx_attend_one(const uint16_t *q, long d, const uint16_t *cache,
                           const int64_t *slots, long len, long c, float scale, uint16_t *out,
                           int heads, AmxRoom *w) {
    amx_take_queries(w, q, heads, d);
    float mx[AMX_HEADS];
    for (int h = 0; h < AMX_HEADS; h++) mx[h] = -INFINITY;
    for (long k0 = 0; k0 < len; k0 += AMX_KEYS) {
        float part[AMX_HEADS]; /* the block's maxima: the row's is the largest (exact) */
        amx_scores_keys(w, w->kp, cache, slots, k0, len - k0 < AMX_KEYS ? len - k0 : AMX_KEYS,
                        d, heads, scale, part);
        for (int h = 0; h < heads; h++) mx[h] = part[h] > mx[h] ? part[h] : mx[h];
    }
    for (int h = 0; h < heads; h++) amx_probs(w, h, len, mx[h]);
    for (long c0 = 0; c0 < c; c0 += 32)
        amx_values_tile(w, w->vp, cache, slots, len, d, c0, heads, out, c);
}

/* amx_attend_one's result, bit for bit, with every thread on the one work item: fewer items
 * than threads (a sequence alone) would otherwise leave threads idle. Each score is its own
 * key's sum, each row's maximum is exact in any order, each row's softmax runs in one thread,
 * and each output column sums its keys in AMX's order on whichever thread: so the split
 * (keys for the scores, heads for the softmax, 32-column tiles for P V) moves no bit. The
 * threads' chunks of keys are whole 32-key blocks, so no tile store crosses into another
 * thread's scores. */
static void amx_attend_split(const uint16_t *q, long d, const uint16_t *cache,
                             const int64_t *slots, long len, long c, float scale, uint16_t *out,
                             int heads, AmxRoom *w, int threads) {
    amx_take_queries(w, q, heads, d);
    const long lc = (len + 31) / 32;
    long chunk = (lc + threads - 1) / threads * 32; /* whole 32-key blocks; len >= 1 */
    if (chunk > AMX_KEYS) chunk = AMX_KEYS;
    const long chunks = (len + chunk - 1) / chunk;
    float *part = malloc(sizeof(float) * chunks * AMX_HEADS);
#pragma omp parallel num_threads(threads)
    {
        uint16_t *kp = w->kp + omp_get_thread_num() * AMX_KEYS * d;
        uint16_t *vp = w->vp + omp_get_thread_num() * w->lc * 1024;
#pragma omp for schedule(static)
        for (long i = 0; i < chunks; i++)
            amx_scores_keys(w, kp, cache, slots, i * chunk,
                            len - i * chunk < chunk ? len - i * chunk : chunk, d, heads, scale,
                            part + i * AMX_HEADS);
#pragma omp for schedule(static)
        for (int h = 0; h < heads; h++) {
            float mx = -INFINITY;
            for (long i = 0; i < chunks; i++)
                mx = part[i * AMX_HEADS + h] > mx ? part[i * AMX_HEADS + h] : mx;
            amx_probs(w, h, len, mx);
        }
#pragma omp for schedule(static)
        for (long c0 = 0; c0 < c; c0 += 32)
            amx_values_tile(w, vp, cache, slots, len, d, c0, heads, out, c);
    }
    free(part);
}

#else /* AVX2 (cpu_avx2.h): the AVX-512 code's sums and exps, lane for lane */

#define HEAD_BLOCK 4 /* heads whose scores share one pass over a key row (8 accumulators) */

static void attend_one(const uint16_t *q, long d, const uint16_t *cache, const int64_t *slots,
                       long len, long c, float scale, uint16_t *out, int heads, float *scores) {
    const long chunks = (d + 31) / 32, full = d / 32;
    float *qw = malloc(sizeof(float) * heads * chunks * 32); /* the queries, widened once */
    mci_widen_rows(q, d, heads, d, qw);
    /* pass 1: scores [heads][len] */
    for (long l = 0; l < len; l++) {
        const uint16_t *row = cache + slots[l] * d;
        for (int h0 = 0; h0 < heads; h0 += HEAD_BLOCK) {
            const int nh = heads - h0 < HEAD_BLOCK ? heads - h0 : HEAD_BLOCK;
            __m256 acc[HEAD_BLOCK][2];
            for (int h = 0; h < HEAD_BLOCK; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
            for (long ch = 0; ch < chunks; ch++) {
                __m256i lo, hi;
                if (ch < full) {
                    lo = _mm256_loadu_si256((const __m256i *)(row + ch * 32));
                    hi = _mm256_loadu_si256((const __m256i *)(row + ch * 32 + 16));
                } else {
                    uint16_t part[32] = {0};
                    __builtin_memcpy(part, row + ch * 32, (d - ch * 32) * sizeof(uint16_t));
                    lo = _mm256_loadu_si256((const __m256i *)part);
                    hi = _mm256_loadu_si256((const __m256i *)(part + 16));
                }
                const __m256 lo_odd = mci_odd8(lo), lo_even = mci_even8(lo);
                const __m256 hi_odd = mci_odd8(hi), hi_even = mci_even8(hi);
                _Pragma("GCC unroll 4") for (int h = 0; h < HEAD_BLOCK; h++) {
                    if (h >= nh) break;
                    const float *qc = qw + ((h0 + h) * chunks + ch) * 32;
                    acc[h][0] = _mm256_fmadd_ps(lo_odd, _mm256_loadu_ps(qc), acc[h][0]);
                    acc[h][0] = _mm256_fmadd_ps(lo_even, _mm256_loadu_ps(qc + 8), acc[h][0]);
                    acc[h][1] = _mm256_fmadd_ps(hi_odd, _mm256_loadu_ps(qc + 16), acc[h][1]);
                    acc[h][1] = _mm256_fmadd_ps(hi_even, _mm256_loadu_ps(qc + 24), acc[h][1]);
                }
            }
            for (int h = 0; h < nh; h++)
                scores[(h0 + h) * len + l] = mci_reduce_halves(acc[h][0], acc[h][1]) * scale;
        }
    }
    /* softmax per head, in place: 16 lanes as two halves, the tail's missing lanes zero */
    float total[MAX_HEADS_PER_ITEM];
    for (int h = 0; h < heads; h++) {
        float *s = scores + h * len;
        float mx = -INFINITY;
        for (long l = 0; l < len; l++) mx = s[l] > mx ? s[l] : mx;
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 sum_lo = _mm256_setzero_ps(), sum_hi = _mm256_setzero_ps();
        long l = 0;
        for (; l + 16 <= len; l += 16) {
            const __m256 e_lo = mci_exp256(_mm256_sub_ps(_mm256_loadu_ps(s + l), vmx));
            const __m256 e_hi = mci_exp256(_mm256_sub_ps(_mm256_loadu_ps(s + l + 8), vmx));
            _mm256_storeu_ps(s + l, e_lo);
            _mm256_storeu_ps(s + l + 8, e_hi);
            sum_lo = _mm256_add_ps(sum_lo, e_lo);
            sum_hi = _mm256_add_ps(sum_hi, e_hi);
        }
        if (l < len) {
            float part[16] __attribute__((aligned(32)));
            for (int i = 0; i < 16; i++) part[i] = l + i < len ? s[l + i] : 0.0f;
            const __m256i keep_lo = mci_mask8((1u << (len - l < 8 ? len - l : 8)) - 1);
            const __m256i keep_hi = mci_mask8(len - l > 8 ? (1u << (len - l - 8)) - 1 : 0);
            const __m256 e_lo = _mm256_and_ps(_mm256_castsi256_ps(keep_lo),
                                              mci_exp256(_mm256_sub_ps(_mm256_load_ps(part), vmx)));
            const __m256 e_hi = _mm256_and_ps(_mm256_castsi256_ps(keep_hi),
                                              mci_exp256(_mm256_sub_ps(_mm256_load_ps(part + 8), vmx)));
            _mm256_store_ps(part, e_lo);
            _mm256_store_ps(part + 8, e_hi);
            for (long i = l; i < len; i++) s[i] = part[i - l];
            sum_lo = _mm256_add_ps(sum_lo, e_lo);
            sum_hi = _mm256_add_ps(sum_hi, e_hi);
        }
        total[h] = mci_reduce_halves(sum_lo, sum_hi);
    }
    /* pass 2: out[h] = sum_l p[h][l] * row[:c], float32 accumulators in L1 (each element's
     * products added in the order of l, as the AVX-512 code does) */
    float acc[MAX_HEADS_PER_ITEM][MAX_LATENT] __attribute__((aligned(32)));
    for (int h = 0; h < heads; h++)
        for (long j = 0; j < c; j++) acc[h][j] = 0.0f;
    const long c_full = c & ~7L;
    for (long l = 0; l < len; l++) {
        const uint16_t *row = cache + slots[l] * d;
        for (long j = 0; j < c_full; j += 8) {
            const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + j))), 16));
            for (int h = 0; h < heads; h++)
                _mm256_store_ps(acc[h] + j, _mm256_fmadd_ps(_mm256_set1_ps(scores[h * len + l]), v,
                                                             _mm256_load_ps(acc[h] + j)));
        }
        for (long j = c_full; j < c; j++)
            for (int h = 0; h < heads; h++)
                acc[h][j] = fmaf(scores[h * len + l], bf16_to_float(row[j]), acc[h][j]);
    }
    for (int h = 0; h < heads; h++) {
        const float inv = 1.0f / total[h];
        for (long j = 0; j < c; j++) out[h * c + j] = round_bf16(acc[h][j] * inv);
    }
    free(qw);
}
#endif

/* Returns 0, or -1 when c or d exceed what the kernel takes (the AVX2 code's fixed buffers;
 * the caller falls back). With `amx` (a CPU with AMX; d and c multiples of 32): each sequence
 * of at most AMX_MAX_KEYS keys on AMX tiles, in work items of whole heads (AMX_HEADS at most),
 * the others as without. A sequence's bits never depend on the batch or the threads (the
 * engine's batch invariance: a request decodes alone as in a batch): with a work item per
 * thread or more, each item on one thread (amx_attend_one); with fewer, each item with every
 * thread in turn (amx_attend_split), or on one below SPLIT_MIN_KEYS; the same sums. */
int mci_bf16_latent_decode_attention(const uint16_t *q, const uint16_t *cache,
                                     const int64_t *slots, long ldslots, const int64_t *lens,
                                     long batch, long heads, long d, long c, float scale,
                                     uint16_t *out, int amx) {
    if (c > MAX_LATENT || d > 4 * MAX_LATENT) return -1;
    const int threads = omp_get_max_threads();
#ifdef __AVX512F__
    amx = amx && d % 32 == 0 && c % 32 == 0;
#else
    amx = 0;
#endif
    long per = heads < AMX_HEADS ? heads : AMX_HEADS;
#ifdef __AVX512F__
    /* the longest context that runs on AMX: the rooms' size; none (every sequence past
     * AMX_MAX_KEYS, as at 8k and 16k of context) -> no room at all, the passes */
    long fit_len = 0;
    for (long b = 0; b < batch; b++)
        if (lens[b] <= AMX_MAX_KEYS && lens[b] > fit_len) fit_len = lens[b];
    if (fit_len == 0) amx = 0;
    int split_done = 0; /* the sequences of at most AMX_MAX_KEYS keys are written */
    /* fewer work items than threads (a sequence alone): each item with every thread in turn
     * (amx_attend_split, the same bits), since splitting its heads would pack its rows once
     * per thread and waste most of a tile */
    if (amx && batch * ((heads + per - 1) / per) < threads) {
        long longer = 0, split = 0;
        for (long b = 0; b < batch; b++)
            split |= lens[b] >= SPLIT_MIN_KEYS && lens[b] <= AMX_MAX_KEYS;
        /* a key and a value pack per thread where one splits, else the caller's alone */
        AmxRoom room = amx_room(fit_len, d, split ? threads : 1);
        for (long b = 0; b < batch; b++) {
            if (lens[b] > AMX_MAX_KEYS) {
                longer++;
                continue;
            }
            for (long h0 = 0; h0 < heads; h0 += per) {
                const int nh = (int)(heads - h0 < per ? heads - h0 : per);
                const uint16_t *qi = q + (b * heads + h0) * d;
                uint16_t *oi = out + (b * heads + h0) * c;
                if (lens[b] < SPLIT_MIN_KEYS)
                    amx_attend_one(qi, d, cache, slots + b * ldslots, lens[b], c, scale, oi, nh,
                                   &room);
                else
                    amx_attend_split(qi, d, cache, slots + b * ldslots, lens[b], c, scale, oi, nh,
                                     &room, threads);
            }
        }
        amx_room_free(&room);
        if (!longer) return 0;
        split_done = 1, amx = 0; /* the longer ones: the passes, their heads over the threads */
    }
#endif
    if (!amx) {
        per = heads;
        /* few sequences: split the heads too, so every thread has work */
        if (batch < threads) per = (heads * batch + threads - 1) / threads;
        if (per > MAX_HEADS_PER_ITEM) per = MAX_HEADS_PER_ITEM;
        if (per < 1) per = 1;
    }
    const long groups = (heads + per - 1) / per;
    const long per_pass = per < MAX_HEADS_PER_ITEM ? per : MAX_HEADS_PER_ITEM; /* attend_one's */
    long max_len = 0;
    for (long b = 0; b < batch; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
#pragma omp parallel
    {
        float *scores = (float *)aligned_alloc(64, ((per_pass * max_len * 4 + 63) / 64) * 64 + 64);
#ifdef __AVX512F__
        AmxRoom room = {0};
        if (amx) room = amx_room(fit_len, d, 1);
#endif
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < batch * groups; item++) {
            const long b = item / groups, h0 = (item % groups) * per;
            const int nh = (int)((heads - h0) < per ? (heads - h0) : per);
            const uint16_t *qi = q + (b * heads + h0) * d;
            uint16_t *oi = out + (b * heads + h0) * c;
#ifdef __AVX512F__
            if (split_done && lens[b] <= AMX_MAX_KEYS) continue;
            if (amx && lens[b] <= AMX_MAX_KEYS) {
                amx_attend_one(qi, d, cache, slots + b * ldslots, lens[b], c, scale, oi, nh,
                               &room);
                continue;
            }
#endif
            /* each head alone, so as many at a time as the scores' room takes */
            for (int hh = 0; hh < nh; hh += MAX_HEADS_PER_ITEM)
                attend_one(qi + hh * d, d, cache, slots + b * ldslots, lens[b], c, scale,
                           oi + hh * c, nh - hh < MAX_HEADS_PER_ITEM ? nh - hh : MAX_HEADS_PER_ITEM,
                           scores);
        }
#ifdef __AVX512F__
        if (amx) amx_room_free(&room);
#endif
        free(scores);
    }
    return 0;
}

/* ---- rotary embedding and the latent cache write (MLA) ------------------------------------
 * rope(v)[i] = v1[i] * cos[i] - v2[i] * sin[i],  rope(v)[h + i] = v2[i] * cos[i] + v1[i] * sin[i]
 * (h = r/2 pairs; interleaved checkpoints pair (2i, 2i+1), the others (i, i + h)): each product
 * and the sum rounded in float32, as mci/layers/rotary.py computes them, then rounded once to
 * bf16. */
static inline void rope_row(const uint16_t *v, const float *cos, const float *sin, long r,
                            int interleave, uint16_t *out) {
    const long h = r / 2;
    long i = 0;
#ifdef __AVX512F__
    /* 16 pairs at a time, the same roundings (each product, the difference or sum, then
     * round_bf16's bits): a prefill's q rows were ~1.6 ns an element one at a time */
    for (; i + 16 <= h; i += 16) {
        __m512 a, b;
        if (interleave) { /* pair i in one 32-bit lane: v[2i] its low half */
            const __m512i lane = _mm512_loadu_si512(v + 2 * i);
            a = _mm512_castsi512_ps(_mm512_slli_epi32(lane, 16));
            b = _mm512_castsi512_ps(_mm512_and_si512(lane, _mm512_set1_epi32((int)0xffff0000u)));
        } else {
            a = widen16(_mm256_loadu_si256((const __m256i *)(v + i)));
            b = widen16(_mm256_loadu_si256((const __m256i *)(v + h + i)));
        }
        const __m512 c = _mm512_loadu_ps(cos + i), s = _mm512_loadu_ps(sin + i);
        const __m512 ac = _mm512_mul_ps(a, c), bs = _mm512_mul_ps(b, s);
        const __m512 bc = _mm512_mul_ps(b, c), as = _mm512_mul_ps(a, s);
        _mm256_storeu_si256((__m256i *)(out + i), rne16(_mm512_sub_ps(ac, bs)));
        _mm256_storeu_si256((__m256i *)(out + h + i), rne16(_mm512_add_ps(bc, as)));
    }
#endif
    for (; i < h; i++) {
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
    PARALLEL_FOR(tokens * heads >= 256, for (long t = 0; t < tokens; t++), {
        for (long hd = 0; hd < heads; hd++)
            rope_row(x + t * ldt + hd * ldh, cos + t * (r / 2), sin + t * (r / 2), r, interleave,
                     out + (t * heads + hd) * r);
    });
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
    PARALLEL_FOR(tokens * d >= PARALLEL_ELEMENTS, for (long t = 0; t < tokens; t++), {
        uint16_t *row = cache + slots[t] * d;
        mci_rms_norm_row(latent + t * ld, 1, w, row, 1, c, eps);
        rope_row(latent + t * ld + c, cos + t * (r / 2), sin + t * (r / 2), r, interleave, row + c);
    });
}

/* y[t, h, :b] = x[t, h, :a] @ w[h]^T for every head h (w [heads, b, a]); x and y address
 * (t, h) at t * ld_t + h * ld_h. The sums are mci_experts_into's, head by head, so equal to
 * the head-major expert_linear that the torch path runs. */
static void per_head(const uint16_t *x, long ldx_t, long ldx_h, const Weight *w, long heads,
                     long a, long b, uint16_t *y, long ldy_t, long ldy_h, long m) {
    /* The heads' weights lie back to back: each thread takes one run of their heads * b rows
     * (a head's rows split where the run ends), so it reads one stream, not a short one per
     * head. Each output's sum is the same whichever thread computes it. Measured on `small`
     * (8 heads, 16 KB a head, 2 threads), one decoding row, TSC, old and new alternating:
     * 17.6-20.0k -> 11.2-13.1k cycles for w_uk_t, 16.6-20.9k -> 11.4-12.1k for w_uv. */
    TEAM_WORK({
        long r0, r1;
        mci_share(heads * b, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
        for (long h = r0 / b; h < heads && h * b < r1; h++) {
            const long n0 = r0 > h * b ? r0 - h * b : 0, n1 = r1 < (h + 1) * b ? r1 - h * b : b;
            const Sink sink = {y + h * ldy_h, ldy_t, 0, 0, 0};
            const Weight wh = expert_weight(w, h, b, a);
            mci_weight_rows(x + h * ldx_h, ldx_t, &wh, a, sink, m, n0, n1);
        }
    });
}

/* The attention sublayer of a decode step, x float32 [t, hidden] (the residual stream) ->
 * out float32 [t, hidden] = x + o_proj(attention(input_layernorm(x))), as
 * DecoderLayer.forward and MultiHeadLatentAttention's absorbed decode path compute it with the
 * kernels: input norm (norm_w), the fused [q | latent] projection (w_qkv_a, q_dim + c + r
 * rows; q_dim = q_lora_rank, or heads * (nope + r) without q_lora, then q_norm_w and w_q_b are
 * NULL), q's norm and up-projection, rope on q and on the new latent rows written to
 * cache[write_slots] (normed with kv_norm_w), q_nope absorbed into the latent space
 * (w_uk_t [heads, c, nope]), attention of each row t over cache[kv_slots[t, :lens[t]]],
 * the values out of the latent space (w_uv [heads, v, c]), o_proj (w_o [hidden, heads * v]).
 * Returns -1 (nothing done) when c exceeds the attention kernel's MAX_LATENT. */
int mci_mla_decode(const float *x, long t, long hidden, const uint16_t *norm_w,
                        float norm_eps, const Weight *w_qkv_a, long q_dim,
                        const uint16_t *q_norm_w, float q_eps, const Weight *w_q_b,
                        long heads, long nope, long r, long c, long v,
                        const uint16_t *kv_norm_w, float kv_eps, const float *cos,
                        const float *sin, int interleave, uint16_t *cache,
                        const int64_t *write_slots, const Weight *w_uk_t,
                        const Weight *w_uv, const int64_t *kv_slots, long ld_slots,
                        const int64_t *lens, float scale, const Weight *w_o, float *out) {
    if (c > MAX_LATENT) return -1;
    const long qk = nope + r, d = c + r, fused = q_dim + c + r;
    const long ldq = q_norm_w ? heads * qk : fused;
    const long size = t * (hidden + fused + (q_norm_w ? q_dim + heads * qk : 0) + heads * d +
                           heads * c + heads * v + hidden);
    uint16_t *xn = malloc(sizeof(uint16_t) * size);
    uint16_t *qa = xn + t * hidden, *qn = qa + t * fused;
    uint16_t *q = q_norm_w ? qn + t * q_dim : qa;
    uint16_t *q_full = q_norm_w ? q + t * heads * qk : qn;
    uint16_t *att = q_full + t * heads * d, *o_in = att + t * heads * c;
    uint16_t *o = o_in + t * heads * v;
    /* up to the queries in one team (its kernels share it; cpu_kernels.h), the attention in
     * its own, the rest in one */
    ONE_TEAM({
        mci_rms_norm(x, hidden, 0, norm_w, xn, 1, t, hidden, norm_eps);
        mci_linear(xn, hidden, w_qkv_a, qa, fused, t, fused, hidden);
        if (q_norm_w) {
            mci_rms_norm(qa, fused, 1, q_norm_w, qn, 1, t, q_dim, q_eps);
            mci_linear(qn, q_dim, w_q_b, q, heads * qk, t, heads * qk, q_dim);
        }
        mci_write_latent_rows(qa + q_dim, fused, kv_norm_w, kv_eps, cos, sin, interleave,
                              cache, write_slots, t, c, r);
        per_head(q, ldq, qk, w_uk_t, heads, nope, c, q_full, heads * d, d, t);
        PARALLEL_FOR(t * heads * r >= PARALLEL_ELEMENTS, for (long i = 0; i < t; i++), {
            for (long h = 0; h < heads; h++)
                rope_row(q + i * ldq + h * qk + nope, cos + i * (r / 2), sin + i * (r / 2), r,
                         interleave, q_full + (i * heads + h) * d + c);
        });
    });
    /* on AMX where the layer's per-head weights are (their amx_rows: 0 in batch invariance,
     * as the torch path's `_amx_rows()`) */
    mci_bf16_latent_decode_attention(q_full, cache, kv_slots, ld_slots, lens, t, heads, d, c,
                                     scale, att, w_uk_t->amx_rows > 0);
    ONE_TEAM({
        per_head(att, heads * c, c, w_uv, heads, c, v, o_in, heads * v, v, t);
        mci_linear(o_in, heads * v, w_o, o, hidden, t, hidden, heads * v);
        PARALLEL_FOR(t * hidden >= PARALLEL_ELEMENTS, for (long i = 0; i < t * hidden; i++),
                     out[i] = x[i] + bf16_to_float(o[i]););
    });
    free(xn);
    return 0;
}
