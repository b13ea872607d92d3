/* The time to read a decode step's weights and do nothing else, on all threads: the floor
 * under any kernel that reads them. Built and driven by read_floor.py.
 *
 * Each buffer is split in contiguous halves (thirds, ...) over the threads, as the matmul
 * kernels split a weight's rows; every 32-byte vector is loaded and folded into an
 * accumulator, so the compiler cannot drop the loads. Three ways to sequence the buffers:
 *   0: one parallel region per buffer (one kernel call each, as mci's kernels run),
 *   1: one parallel region for the step, a barrier after each buffer (as a thread pool that
 *      stays up for the whole step must wait: the next matmul needs the previous one's
 *      output),
 *   2: one parallel region, no barrier at all (no dependency between buffers: not a step a
 *      model can take, the bandwidth floor in this access pattern).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

static inline __m256i read_share(const uint8_t *p, long n, int id, int count, __m256i acc) {
    const long vectors = n / 32, per = (vectors + count - 1) / count;
    const long v0 = id * per, v1 = v0 + per < vectors ? v0 + per : vectors;
    const __m256i *v = (const __m256i *)p;
    long i = v0;
    for (; i + 4 <= v1; i += 4) {
        acc = _mm256_xor_si256(acc, _mm256_loadu_si256(v + i));
        acc = _mm256_add_epi64(acc, _mm256_loadu_si256(v + i + 1));
        acc = _mm256_xor_si256(acc, _mm256_loadu_si256(v + i + 2));
        acc = _mm256_add_epi64(acc, _mm256_loadu_si256(v + i + 3));
    }
    for (; i < v1; i++) acc = _mm256_xor_si256(acc, _mm256_loadu_si256(v + i));
    return acc;
}

static inline int64_t fold(__m256i acc) {
    return _mm256_extract_epi64(acc, 0) ^ _mm256_extract_epi64(acc, 1) ^
           _mm256_extract_epi64(acc, 2) ^ _mm256_extract_epi64(acc, 3);
}

int64_t read_step(const uint8_t *const *buffers, const long *sizes, long n, int mode) {
    int64_t total = 0;
    if (mode == 0) {
        for (long b = 0; b < n; b++) {
#pragma omp parallel reduction(^ : total)
            total ^= fold(read_share(buffers[b], sizes[b], omp_get_thread_num(),
                                     omp_get_num_threads(), _mm256_setzero_si256()));
        }
        return total;
    }
#pragma omp parallel reduction(^ : total)
    {
        const int id = omp_get_thread_num(), count = omp_get_num_threads();
        __m256i acc = _mm256_setzero_si256();
        for (long b = 0; b < n; b++) {
            acc = read_share(buffers[b], sizes[b], id, count, acc);
            if (mode == 1) {
#pragma omp barrier
            }
        }
        total ^= fold(acc);
    }
    return total;
}
