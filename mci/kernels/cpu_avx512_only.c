/* The AVX-512-only kernels' entry points in the AVX2 library (build.py): FP8 (AVX512-VBMI's
 * byte lookups, cpu_fp8.c), the bf16 GEMM (cpu_gemm.c) and AMX (cpu_amx.c) do not run on such
 * a CPU, and nothing calls them there (CpuKernels.fp8, .amx and .gemm are False; cpu_moe.c
 * hands busy experts back to the caller). They exist so the shared kernels link; reaching one
 * is a bug, so it aborts rather than return wrong numbers. */
#include <stdlib.h>

#include "cpu_kernels.h"

void mci_fp8_rows_range(const uint16_t *x, long ldx, const Weight *w, long k, Sink y, long m,
                        long n0, long n1) {
    (void)x, (void)ldx, (void)w, (void)k, (void)y, (void)m, (void)n0, (void)n1;
    abort();
}

void mci_bf16_gemm(const uint16_t *x, long ldx, const uint16_t *w, long k, Sink y, long m,
                   long n0, long n1) {
    (void)x, (void)ldx, (void)w, (void)k, (void)y, (void)m, (void)n0, (void)n1;
    abort();
}

int mci_fp8_skinny_rows(void) { return 0; }

int mci_amx_init(void) { return -1; }

void mci_amx_pack(const uint16_t *w, long experts, long n, long k, uint16_t *out) {
    (void)w, (void)experts, (void)n, (void)k, (void)out;
    abort();
}

void mci_amx_experts_into(const uint16_t *x, long ldx, const uint16_t *packed, Sink y,
                          const int64_t *ids, const int64_t *starts, const int64_t *counts,
                          long segments, long n, long k) {
    (void)x, (void)ldx, (void)packed, (void)y, (void)ids, (void)starts, (void)counts;
    (void)segments, (void)n, (void)k;
    abort();
}

void mci_amx_gated_experts_into(const uint16_t *x, long ldx, const uint16_t *packed, Sink y,
                                const int64_t *ids, const int64_t *starts,
                                const int64_t *counts, long segments, long n, long k) {
    (void)x, (void)ldx, (void)packed, (void)y, (void)ids, (void)starts, (void)counts;
    (void)segments, (void)n, (void)k;
    abort();
}

void mci_amx_packed_linear(const uint16_t *x, long ldx, const uint16_t *packed, Sink y, long m,
                           long n, long k, int gated) {
    (void)x, (void)ldx, (void)packed, (void)y, (void)m, (void)n, (void)k, (void)gated;
    abort();
}

void mci_amx_rows_range(const uint16_t *x, long ldx, const uint16_t *w, long k, Sink y, long m,
                        long n0, long n1) {
    (void)x, (void)ldx, (void)w, (void)k, (void)y, (void)m, (void)n0, (void)n1;
    abort();
}

void mci_amx_scores(const uint16_t *q, long ldq, long d, const uint16_t *kp, long nkb,
                    float scale, float *s, long lds, const long *limits, float *mx) {
    (void)q, (void)ldq, (void)d, (void)kp, (void)nkb, (void)scale, (void)s, (void)lds;
    (void)limits, (void)mx;
    abort();
}

void mci_amx_pv(const uint16_t *p, long ldp, const uint16_t *vp, long lc, long nkc, long dv,
                int rows, uint16_t *out, long ld_out) {
    (void)p, (void)ldp, (void)vp, (void)lc, (void)nkc, (void)dv, (void)rows, (void)out;
    (void)ld_out;
    abort();
}
