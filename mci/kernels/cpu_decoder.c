/* A decode step's decoder layers, several per call (mci/kernels/cpu_decoder.py): each layer's
 * kernel calls, as its forward makes them on such a step (models/decoder_layer.py), one layer
 * after the next, without returning to Python between them.
 *
 * A span of a step: first, optionally, the MoE of the layer the previous span stopped in (its
 * normed input is in `normed`, its router's logits come from the caller), then each layer of
 * `layers`: attention (mci_mla_decode, which adds the residual), the feed-forward's RMSNorm,
 * and for a dense layer its gated MLP and residual sum. A MoE layer ends the span after its
 * norm: its router's float32 matmul (MKL's sum order, which the routing's bits rest on) runs
 * between spans, and its logits go to the next span. `mci_decoder_step` runs a whole step
 * (embedding to final norm, optionally the LM head) and the routers itself, through the BLAS
 * sgemm torch's F.linear calls; `mci_decoder_span` alone leaves them to the caller's torch.
 *
 * `mci_decode_steps` runs several whole steps of greedy decoding, each step's tokens the next
 * one's input, without returning to Python between them (mci/scheduler/steps_ahead.py).
 *
 * Every step is the same C function the Python path calls, on the same values, and each sum
 * adds the same two float32 values as torch's `h + ffn`: the result is bit-identical to that
 * path (tests/test_cpu_kernels.py's bound-step test). */

#include <math.h>
#include <poll.h>
#include <string.h>
#include <time.h>

#include "cpu_kernels.h"

/* mci_mla_decode's, mci_moe's and mci_gated_mlp's fixed arguments for one layer (cpu_mla.c,
 * cpu_moe.c), each group in its function's parameter order. */
typedef struct {
    /* attention */
    const uint16_t *norm_w;
    float norm_eps;
    const Weight *w_qkv_a;
    long q_dim;
    const uint16_t *q_norm_w;
    float q_eps;
    const Weight *w_q_b;
    long heads, nope, r, c, v;
    const uint16_t *kv_norm_w;
    float kv_eps;
    int interleave;
    const Weight *w_uk_t, *w_uv;
    float scale;
    const Weight *w_o;
    long cache_row; /* the layer's row of the latent cache */
    /* the feed-forward's input norm */
    const uint16_t *ffn_norm_w;
    float ffn_norm_eps;
    int moe; /* 0: a dense gated MLP (w_gate_up, w_down, inter); 1: the one-call MoE */
    const Weight *w_gate_up, *w_down;
    long inter;
    /* the MoE's router constants, AMX-packed experts and shared experts */
    const float *bias;
    long e, n_group, topk_group, top_k;
    int norm_topk;
    float scaling;
    const uint16_t *amx_gate_up, *amx_down;
    const Weight *w_s_gate_up, *w_s_down;
    const uint16_t *amx_s_gate_up, *amx_s_down;
    long s_inter, max_rows;
    /* the router's float32 weight [e, hidden] for mci_decoder_step (NULL: the caller routes) */
    const float *router_w;
} DecodeLayer;

/* What changes from step to step: t rows of `hidden`, their rope tables, the latent cache
 * [rows, cache_row_stride] and the decode group's slots. */
typedef struct {
    long t, hidden;
    const float *cos, *sin;
    uint16_t *cache;
    long cache_row_stride;
    const int64_t *write_slots, *kv_slots;
    long ld_slots;
    const int64_t *lens;
} DecodeStep;

/* x[i] = h[i] + x[i] over t rows (torch's `h + ffn`, one rounding per element). */
static void add_into(float *x, const float *h, long n) {
    PARALLEL_FOR(n >= PARALLEL_ELEMENTS, for (long i = 0; i < n; i++), x[i] = h[i] + x[i];);
}

/* x [t, hidden] float32 (the residual stream, updated in place), h [t, hidden] float32 (each
 * layer's stream after attention), normed [t, hidden] float32 room (the feed-forward's input:
 * float32 for a MoE, bf16 for a dense MLP). Returns 0; 1 where `finish`'s MoE refuses the
 * step (mci_moe's AVX2 case, an expert over max_rows: never at the rows a layer is bound at,
 * at most max_rows in all) and -1 where attention refuses a layer (its latent rank). */
int mci_decoder_span(const DecodeStep *s, const DecodeLayer *finish, const float *logits,
                     const DecodeLayer *layers, long count, float *x, float *h, void *normed) {
    const long t = s->t, hidden = s->hidden, n = t * hidden;
    if (t <= 0) return 0;
    if (finish) {
        const DecodeLayer *L = finish;
        float weights[t * L->top_k];
        int64_t ids[t * L->top_k];
        if (mci_moe(normed, logits, L->bias, t, L->e, L->n_group, L->topk_group, L->top_k,
                    L->norm_topk, L->scaling, weights, ids, L->w_gate_up, L->w_down,
                    L->amx_gate_up, L->amx_down, hidden, L->inter, L->w_s_gate_up, L->w_s_down,
                    L->amx_s_gate_up, L->amx_s_down, L->s_inter, L->max_rows, x))
            return 1;
        add_into(x, h, n);
    }
    for (long i = 0; i < count; i++) {
        const DecodeLayer *L = layers + i;
        uint16_t *cache = s->cache + L->cache_row * s->cache_row_stride;
        if (mci_mla_decode(x, t, hidden, L->norm_w, L->norm_eps, L->w_qkv_a, L->q_dim,
                           L->q_norm_w, L->q_eps, L->w_q_b, L->heads, L->nope, L->r, L->c, L->v,
                           L->kv_norm_w, L->kv_eps, s->cos, s->sin, L->interleave, cache,
                           s->write_slots, L->w_uk_t, L->w_uv, s->kv_slots, s->ld_slots, s->lens,
                           L->scale, L->w_o, h))
            return -1;
        mci_rms_norm(h, hidden, 0, L->ffn_norm_w, normed, !L->moe, t, hidden, L->ffn_norm_eps);
        if (L->moe) return 0; /* the caller's router, then the next span finishes it */
        /* the bf16 input fills the first half of normed's float32 room, the output the second */
        uint16_t *y = (uint16_t *)normed + n;
        mci_gated_mlp(normed, hidden, L->w_gate_up, L->w_down, t, hidden, L->inter, y);
        PARALLEL_FOR(n >= PARALLEL_ELEMENTS, for (long j = 0; j < n; j++),
                     x[j] = h[j] + bf16_to_float(y[j]););
    }
    return 0;
}

/* BLAS's sgemm (Fortran interface, 32-bit integers): the one torch's float32 F.linear calls on
 * the CPU (MKL's), passed in by the caller, which checks its bits against F.linear's first. */
typedef void (*Sgemm)(const char *transa, const char *transb, const int *m, const int *n,
                      const int *k, const float *alpha, const float *a, const int *lda,
                      const float *b, const int *ldb, const float *beta, float *c,
                      const int *ldc);

/* logits [t, e] = x [t, hidden] @ w [e, hidden]^T as F.linear calls BLAS: column-major
 * logits^T = w^T' x^T, i.e. sgemm("T", "N", e, t, hidden, 1, w, hidden, x, hidden, 0, ...). */
static void router_logits(Sgemm sgemm, const float *w, const float *x, long t, long hidden,
                          long e, float *logits) {
    const int m = (int)e, n = (int)t, k = (int)hidden;
    const float one = 1.0f, zero = 0.0f;
    sgemm("T", "N", &m, &n, &k, &one, w, &k, x, &k, &zero, logits, &m);
}

/* A decode step's whole decoder: the t input ids' embedding rows (bf16 [vocab, hidden], widened
 * to float32 into x), their rope rows (cos/sin tables [table_rows, half] float32) at
 * `positions`, every layer's span with each MoE router's matmul in between (`sgemm`, on the
 * layer's router_w, which none may lack), and the final RMSNorm into `out` (bf16 [t, hidden]).
 * x, h and normed as mci_decoder_span's; logits float32 [t, max e] room. With `head`, the LM
 * head's matmul [head_rows, hidden] of `out` too, rounded to bf16 as the kernels' matmuls are,
 * then widened into head_out (float32 [t, head_rows]: lm_head.logits's values). The same
 * values as the model's forward (and its lm_head) on that step: the same lookups, kernels and
 * BLAS call, in the same order.
 * Returns mci_decoder_span's status, -2 for an id outside [0, vocab) or a position outside
 * the tables, -3 for a MoE layer without router_w, -4 where memory ran out. */
int mci_decoder_step(const DecodeStep *s, const DecodeLayer *layers, long count, Sgemm sgemm,
                     const int64_t *ids, const uint16_t *embed, long vocab,
                     const float *cos_table, const float *sin_table, long table_rows,
                     long half, const int64_t *positions, const uint16_t *norm_w, float norm_eps,
                     uint16_t *out, float *x, float *h, void *normed, float *logits,
                     const Weight *head, long head_rows, float *head_out) {
    const long t = s->t, hidden = s->hidden;
    if (t <= 0) return 0;
    for (long i = 0; i < t; i++)
        if (ids[i] < 0 || ids[i] >= vocab || positions[i] < 0 || positions[i] >= table_rows)
            return -2;
    for (long i = 0; i < t; i++) {
        const uint16_t *row = embed + ids[i] * hidden;
        for (long j = 0; j < hidden; j++) x[i * hidden + j] = bf16_to_float(row[j]);
    }
    float cos[t * half], sin[t * half];
    for (long i = 0; i < t; i++) {
        memcpy(cos + i * half, cos_table + positions[i] * half, sizeof(float) * half);
        memcpy(sin + i * half, sin_table + positions[i] * half, sizeof(float) * half);
    }
    DecodeStep step = *s;
    step.cos = cos;
    step.sin = sin;
    const DecodeLayer *finish = NULL;
    long start = 0;
    for (long i = 0; i <= count; i++) {
        if (i < count && !layers[i].moe) continue;
        /* layers [start, i] (the MoE layer i's block up to its norm), or the last ones */
        const long n = (i < count ? i + 1 : count) - start;
        const int status = mci_decoder_span(&step, finish, logits, layers + start, n, x, h, normed);
        if (status != 0) return status;
        if (i == count) break;
        if (!layers[i].router_w) return -3;
        router_logits(sgemm, layers[i].router_w, normed, t, hidden, layers[i].e, logits);
        finish = layers + i;
        start = i + 1;
    }
    mci_rms_norm(x, hidden, 0, norm_w, out, 1, t, hidden, norm_eps);
    if (head) {
        uint16_t *bf = malloc(sizeof(uint16_t) * t * head_rows);
        if (!bf) return -4;
        mci_linear(out, hidden, head, bf, head_rows, t, head_rows, hidden);
        const long n_out = t * head_rows;
        PARALLEL_FOR(n_out >= PARALLEL_ELEMENTS, for (long i = 0; i < n_out; i++),
                     head_out[i] = bf16_to_float(bf[i]););
        free(bf);
    }
    return 0;
}

/* The loop of `mci_decode_steps`: at most `steps` steps; it ends early after a step that drew
 * one of `stops` in any row, once `wake_fd` is readable (a command waits for the engine: -1,
 * never), or once `budget_s` seconds have passed since it began (0: no limit). `tokens`
 * [steps, t] room receives each step's tokens; `ran`, the steps run. */
typedef struct {
    long steps;
    const int64_t *stops;
    long n_stops;
    int wake_fd;
    double budget_s;
    int64_t *tokens;
    long ran;
} StepLoop;

static double monotonic_s(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

/* The row's first maximum, or its first NaN where it has one: numpy's argmax, which the
 * sampler's greedy draw uses (runner/sampler.py's _argmax). */
static int64_t first_argmax(const float *row, long n) {
    if (isnan(row[0])) return 0;
    int64_t best = 0;
    float top = row[0];
    for (long j = 1; j < n; j++) {
        if (row[j] > top) {
            top = row[j];
            best = j;
        } else if (isnan(row[j])) {
            return j;
        }
    }
    return best;
}

static int readable(int fd) {
    if (fd < 0) return 0;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, 0) > 0;
}

/* Greedy decoding, up to loop->steps steps of `mci_decoder_step` (its arguments, `head`
 * required): each step's tokens are its rows' first-maximum logits, and the next step's ids;
 * each row's position and context length grow by one a step, its next latent going to the
 * slot after its context in `kv_slots` (s's table must hold lens[r] + steps - 1 slots for row
 * r). ids, positions and s's slots are read, never written. The values are those of as many
 * separate steps, each sampled greedily: the same calls on the same inputs.
 * Returns mci_decoder_step's status (loop->ran steps finished before it), or -5 without a
 * head. */
int mci_decode_steps(const DecodeStep *s, const DecodeLayer *layers, long count, Sgemm sgemm,
                     const int64_t *ids, const uint16_t *embed, long vocab,
                     const float *cos_table, const float *sin_table, long table_rows,
                     long half, const int64_t *positions, const uint16_t *norm_w, float norm_eps,
                     uint16_t *out, float *x, float *h, void *normed, float *logits,
                     const Weight *head, long head_rows, float *head_out, StepLoop *loop) {
    const long t = s->t;
    loop->ran = 0;
    if (!head) return -5;
    if (t <= 0) return 0;
    int64_t step_ids[t], step_positions[t], lens[t], write_slots[t];
    memcpy(step_ids, ids, sizeof(int64_t) * t);
    memcpy(step_positions, positions, sizeof(int64_t) * t);
    memcpy(lens, s->lens, sizeof(int64_t) * t);
    memcpy(write_slots, s->write_slots, sizeof(int64_t) * t);
    DecodeStep step = *s;
    step.lens = lens;
    step.write_slots = write_slots;
    const double began = loop->budget_s > 0 ? monotonic_s() : 0;
    for (long k = 0; k < loop->steps; k++) {
        const int status = mci_decoder_step(&step, layers, count, sgemm, step_ids, embed, vocab,
                                            cos_table, sin_table, table_rows, half,
                                            step_positions, norm_w, norm_eps, out, x, h, normed,
                                            logits, head, head_rows, head_out);
        if (status != 0) return status;
        int stop = 0;
        for (long r = 0; r < t; r++) {
            const int64_t token = first_argmax(head_out + r * head_rows, head_rows);
            loop->tokens[k * t + r] = token;
            for (long i = 0; i < loop->n_stops; i++) stop |= token == loop->stops[i];
            step_ids[r] = token;
        }
        loop->ran = k + 1;
        if (stop || k + 1 == loop->steps || readable(loop->wake_fd)) break;
        if (loop->budget_s > 0 && monotonic_s() - began >= loop->budget_s) break;
        for (long r = 0; r < t; r++) {
            write_slots[r] = s->kv_slots[r * s->ld_slots + lens[r]];
            lens[r] += 1;
            step_positions[r] += 1;
        }
    }
    return 0;
}
