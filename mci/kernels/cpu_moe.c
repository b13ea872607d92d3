/* Feed-forward blocks in one call each: the SiLU-gated MLP (dense layers, shared experts) at
 * decode sizes, and DeepSeek's MoE after its router matmul (routing, dispatch, the routed
 * experts on the skinny kernels or, for prefill chunks, on AMX tiles (cpu_amx.c), their
 * weighted sum, the shared experts).
 *
 * Why: at a few rows these blocks are ~45 small torch ops per MoE layer (the router's top-k
 * steps, a sort, a bincount, index copies, two kernel calls, silu, mul, adds), each costing
 * more in dispatch than in arithmetic. Here they are one call: the matmuls are
 * cpu_matvec.c's, and every other step computes what the torch code it stands in for does,
 * in the same float32 operations and roundings (mci/layers/moe.py, mci/layers/mlp.py):
 *
 *   silu_mul   act = bf16(bf16(g / (1 + exp(-g))) * u)          (torch's bf16 silu, then mul)
 *   routing    scores = 1 / (1 + exp(-logits)); choice = scores + bias; group-limited top-k;
 *              weights = scores at the chosen experts [/ (their sum + 1e-20)] * scaling
 *   combine    out[t] = sum over t's experts in expert order of weight * bf16(expert(x[t]))
 *              (+ bf16 shared(x[t])), all float32
 *
 * The exps are this library's polynomial (exp512) or libm's expf, not torch's Sleef ones:
 * within a float32 ulp, which the bf16 rounding after silu hides, but a router score may
 * differ in its last bit, and an exactly tied expert choice may fall the other way.
 */
#include <string.h>

#include "cpu_kernels.h"

/* act [rows, inter] = silu(gu[:, :inter]) * gu[:, inter:], both steps rounded to bf16 as
 * torch's bf16 ops do; gu [rows, 2 * inter] contiguous. */
static void silu_mul(const uint16_t *gu, long rows, long inter, uint16_t *act) {
    PARALLEL_FOR(rows * inter >= PARALLEL_ELEMENTS, for (long r = 0; r < rows; r++), {
        const uint16_t *g = gu + r * 2 * inter, *u = g + inter;
        uint16_t *out = act + r * inter;
        for (long i = 0; i < inter; i += 16) {
            const __mmask16 m = (inter - i) >= 16 ? (__mmask16)0xffff
                                                  : (__mmask16)((1u << (inter - i)) - 1);
            const __m256i act = silu_mul16(_mm256_maskz_loadu_epi16(m, g + i),
                                           _mm256_maskz_loadu_epi16(m, u + i));
            _mm256_mask_storeu_epi16(out + i, m, act);
        }
    });
}

/* mci_gated_mlp in one team (the caller's, or its own), its intermediates in the caller's
 * room [m, 3 * inter]: gate and up, then their product. */
static void gated_mlp_with_room(const uint16_t *x, long ldx, const Weight *w_gate_up,
                                const Weight *w_down, long m, long hidden, long inter,
                                uint16_t *room, uint16_t *y) {
    uint16_t *act = room + m * 2 * inter;
    ONE_TEAM({
        mci_linear(x, ldx, w_gate_up, room, 2 * inter, m, 2 * inter, hidden);
        silu_mul(room, m, inter, act);
        mci_linear(act, inter, w_down, y, hidden, m, hidden, inter);
    });
}

/* y [m, hidden] bf16 = down(silu(gate(x)) * up(x)): x [m, hidden] bf16 (row stride ldx),
 * w_gate_up [2 * inter, hidden], w_down [hidden, inter]. Never inside a team (its room is
 * its own). */
void mci_gated_mlp(const uint16_t *x, long ldx, const Weight *w_gate_up, const Weight *w_down,
                   long m, long hidden, long inter, uint16_t *y) {
    uint16_t *room = malloc(sizeof(uint16_t) * m * 3 * inter);
    gated_mlp_with_room(x, ldx, w_gate_up, w_down, m, hidden, inter, room, y);
    free(room);
}

/* One token's routing (TopKRouter.forward after its matmul): ids in descending choice order. */
static void route(const float *logits, const float *bias, long e, long n_group, long topk_group,
                  long top_k, int norm, float scaling, float *scores, float *choice,
                  float *weights, int64_t *ids) {
    for (long i = 0; i < e; i++) {
        scores[i] = 1.0f / (1.0f + expf(-logits[i]));
        choice[i] = scores[i] + bias[i];
    }
    if (n_group > 1) {
        const long size = e / n_group;
        float group_score[n_group];
        for (long g = 0; g < n_group; g++) {  /* the sum of the group's top two */
            float a = -INFINITY, b = -INFINITY;
            for (long i = g * size; i < (g + 1) * size; i++) { /* selects, not branches */
                const float c = choice[i];
                const int above = c > a;
                b = above ? a : (c > b ? c : b);
                a = above ? c : a;
            }
            group_score[g] = a + b;
        }
        char keep[n_group];
        memset(keep, 0, n_group);
        for (long k = 0; k < topk_group; k++) {
            long best = -1;
            for (long g = 0; g < n_group; g++)
                if (!keep[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
            keep[best] = 1;
        }
        for (long g = 0; g < n_group; g++)
            if (!keep[g])
                for (long i = g * size; i < (g + 1) * size; i++) choice[i] = -INFINITY;
    }
    float sum = 0.0f;
    char taken[e]; /* an expert already chosen: one flag each, not a scan of the ids so far */
    memset(taken, 0, e);
    for (long k = 0; k < top_k; k++) {
        long best = -1;
        float top = 0.0f; /* choice[best] */
        for (long i = 0; i < e; i++) {
            const int better = !taken[i] && (best < 0 || choice[i] > top);
            best = better ? i : best;
            top = better ? choice[i] : top;
        }
        taken[best] = 1;
        ids[k] = best;
        weights[k] = scores[best];
        sum += weights[k];
    }
    for (long k = 0; k < top_k; k++) {
        if (norm) weights[k] = weights[k] / (sum + 1e-20f);
        weights[k] = weights[k] * scaling;
    }
}

/* out [t, hidden] += the shared experts of xb [t, hidden] (x rounded to bf16) on AMX tiles,
 * from their packed weights: the routed experts' kernel (the threads splitting the rows), as
 * an expert every token takes with weight 1 after its routed ones. The same float32
 * additions as the in-call path below (v * 1 is v), the shared outputs each rounded once to
 * bf16 in AMX's order. */
static void shared_on_amx(const uint16_t *xb, long t, long hidden, const uint16_t *amx_gate_up,
                          const uint16_t *amx_down, long inter, float *out) {
    uint16_t *act = alloc64(sizeof(uint16_t) * t * inter);
    int64_t *tokens = malloc(sizeof(int64_t) * t);
    float *ones = malloc(sizeof(float) * t);
    for (long r = 0; r < t; r++) {
        tokens[r] = r;
        ones[r] = 1.0f;
    }
    const Sink act_rows = {act, inter, 0, 0, 0}, combine = {0, hidden, out, tokens, ones};
    mci_amx_packed_linear(xb, hidden, amx_gate_up, act_rows, t, 2 * inter, hidden, 1);
    mci_amx_packed_linear(act, inter, amx_down, combine, t, hidden, inter, 0);
    free(act);
    free(tokens);
    free(ones);
}

/* The MoE block: x float32 [t, hidden] (rounded to bf16 for the experts, as MoE.forward
 * does), logits float32 [t, e] (the router's matmul), bias float32 [e]; w_gate_up
 * [e, 2 * inter, hidden], w_down [e, hidden, inter] (stacked, bf16 or FP8), and the same packed for
 * AMX (amx_gate_up with its gate and up rows interleaved 16 at a time, amx_down: cpu_amx.c,
 * cpu_kernels.h) or NULL; the shared experts' w_s_gate_up
 * [2 * s_inter, hidden] and w_s_down [hidden, s_inter], or NULL; or instead the same packed
 * for AMX as one expert each (amx_s_gate_up interleaved, amx_s_down), or NULL. Experts with at most
 * max_rows tokens each run on the skinny kernels; busier ones on AMX where the weights are
 * packed for it, else on cpu_gemm.c's GEMM (bf16; FP8 weights take cpu_fp8.c's GEMM above
 * its own bound). Always writes each token's routing, weights [t, top_k] and ids [t, top_k].
 * Returns 1, and stops there, when an expert has more than max_rows tokens in the AVX2 build
 * (no GEMM: the caller's grouped matmuls suit that step better); else writes out float32
 * [t, hidden] and returns 0. */
int mci_moe(const float *x, const float *logits, const float *bias, long t, long e,
            long n_group, long topk_group, long top_k, int norm, float scaling, float *weights,
            int64_t *ids, const Weight *w_gate_up, const Weight *w_down,
            const uint16_t *amx_gate_up, const uint16_t *amx_down, long hidden, long inter,
            const Weight *w_s_gate_up, const Weight *w_s_down, const uint16_t *amx_s_gate_up,
            const uint16_t *amx_s_down, long s_inter, long max_rows, float *out) {
    /* a token's routing as ~16 elementwise steps per expert (its exp, the group and top-k
     * scans): 32 tokens of 32 experts split */
    PARALLEL_FOR(t * e * 16 >= PARALLEL_ELEMENTS, for (long r = 0; r < t; r++), {
        float scores[e], choice[e];
        route(logits + r * e, bias, e, n_group, topk_group, top_k, norm, scaling, scores, choice,
              weights + r * top_k, ids + r * top_k);
    });
    /* assignments a = r * top_k + k sorted by expert, then by a (MoE's stable argsort) */
    const long a_count = t * top_k;
    int64_t counts[e], first[e];
    memset(counts, 0, sizeof(counts));
    for (long a = 0; a < a_count; a++) counts[ids[a]]++;
    int64_t seg_ids[e], seg_starts[e], seg_counts[e];
    long segments = 0, start = 0, busiest = 0;
    for (long i = 0; i < e; i++) busiest = counts[i] > busiest ? counts[i] : busiest;
    const int amx = busiest > max_rows && amx_gate_up;
#ifndef __AVX512F__
    if (busiest > max_rows) return 1; /* no GEMM in the AVX2 build */
#endif
    for (long i = 0; i < e; i++) {
        first[i] = start;
        if (counts[i]) {
            seg_ids[segments] = i;
            seg_starts[segments] = start;
            seg_counts[segments++] = counts[i];
        }
        start += counts[i];
    }
    /* Each buffer its own allocation: at `small`'s 4,096-token prefill chunk each is at most
     * 16 MB, under the mmap threshold the engine gives glibc (mci/process_tuning.py), so they
     * come back from the heap each layer; one block of all of them (42 MB) was above it, and
     * every layer page-faulted it in and unmapped it again. Bigger models' chunks still take
     * fresh mappings. */
    int64_t *tokens = malloc(sizeof(int64_t) * a_count);
    float *sorted_weights = malloc(sizeof(float) * a_count);
    uint16_t *xs = alloc64(sizeof(uint16_t) * a_count * hidden); /* tiles' rows: alloc64 */
    uint16_t *gu = amx ? NULL : alloc64(sizeof(uint16_t) * a_count * 2 * inter);
    uint16_t *act = alloc64(sizeof(uint16_t) * a_count * inter);
    for (long a = 0; a < a_count; a++) {
        const long row = first[ids[a]]++;
        tokens[row] = a / top_k;
        sorted_weights[row] = weights[a];
    }
    /* x's rows for the shared experts, then (on the kernels) their bf16 outputs; s_room: their
     * gated MLP's intermediates */
    const int shared_in_call = w_s_gate_up != NULL, with_shared = w_s_gate_up || amx_s_gate_up;
    uint16_t *xb = with_shared ? alloc64(sizeof(uint16_t) * (shared_in_call ? 2 : 1) * t * hidden)
                               : NULL;
    uint16_t *shared = shared_in_call ? xb + t * hidden : NULL;
    uint16_t *s_room = shared_in_call ? malloc(sizeof(uint16_t) * t * 3 * s_inter) : NULL;
    const Sink rows = {gu, 2 * inter, 0, 0, 0};
    const Sink combine = {0, hidden, out, tokens, sorted_weights};
    memset(out, 0, sizeof(float) * t * hidden);
    /* up to the AMX kernels' calls in one team (cpu_kernels.h): each expert's rows of x and the
     * shared experts' x rounded to bf16 (round_bf16 per copy: the same bits as rounding once),
     * the routed experts on the skinny kernels, the shared experts' outputs */
    ONE_TEAM({
        PARALLEL_FOR(a_count * hidden >= PARALLEL_ELEMENTS,
                     for (long row = 0; row < a_count; row++),
                     round_row(x + tokens[row] * hidden, xs + row * hidden, hidden););
        if (!amx) {
            mci_experts_into(xs, hidden, w_gate_up, rows, seg_ids, seg_starts, seg_counts,
                             segments, 2 * inter, hidden, max_rows);
            silu_mul(gu, a_count, inter, act);
            mci_experts_into(act, inter, w_down, combine, seg_ids, seg_starts, seg_counts,
                             segments, hidden, inter, max_rows);
        }
        if (xb)
            PARALLEL_FOR(t * hidden >= PARALLEL_ELEMENTS, for (long r = 0; r < t; r++),
                         round_row(x + r * hidden, xb + r * hidden, hidden););
        if (shared_in_call)
            gated_mlp_with_room(xb, hidden, w_s_gate_up, w_s_down, t, hidden, s_inter, s_room,
                                shared);
    });
    if (amx) { /* the activations straight from the tiles (gate and up packed interleaved) */
        const Sink act_rows = {act, inter, 0, 0, 0};
        mci_amx_gated_experts_into(xs, hidden, amx_gate_up, act_rows, seg_ids, seg_starts,
                                   seg_counts, segments, 2 * inter, hidden);
        mci_amx_experts_into(act, inter, amx_down, combine, seg_ids, seg_starts, seg_counts,
                             segments, hidden, inter);
    }
    /* the shared experts after the routed ones, as MoE.forward adds them */
    if (shared_in_call) /* out + shared: float32 + bf16 */
        PARALLEL_FOR(t * hidden >= PARALLEL_ELEMENTS, for (long i = 0; i < t * hidden; i++),
                     out[i] += bf16_to_float(shared[i]););
    else if (with_shared) /* on AMX tiles, as one more expert of every token, last */
        shared_on_amx(xb, t, hidden, amx_s_gate_up, amx_s_down, s_inter, out);
    free(xb);
    free(s_room);
    free(tokens);
    free(sorted_weights);
    free(xs);
    free(gu);
    free(act);
    return 0;
}
