/*
 * out (T, N) bf16 = x (T, K) bf16 times the transpose of w (N, K) bf16 as stored, each output
 * (plus bias) summed in fp32 and rounded once: F.linear for the few rows of a decode step. oneDNN's GEMM
 * costs about 50 us a call more than the products when its own state has left the caches,
 * which is every call of a step whose weights stream through them (a MoE's experts, a
 * model larger than the last-level cache): measured on a 2-core AVX512-BF16 machine after
 * 100 MB of other reads, 16 rows of a 512 x 1024 projection took 57 us here, 108 in oneDNN
 * (prepacked); 1 row of 576 x 3072, 65 against 117. Work items are blocks of 16 weight
 * rows (bf16_dots.h), split evenly over the threads; N need not be a multiple of 16 (the
 * last block is copied into a zero-padded one), K must be a multiple of 2 * VL.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_dots.h"
#include "vec.h"

/* bias: N floats added before the rounding, or NULL. Returns 1 when out of memory. */
int linear_bf16(uint16_t *out, const uint16_t *x, int64_t T, int64_t K, const uint16_t *w, const float *bias,
                int64_t N) {
    const int64_t full = N / BLOCK, blocks = (N + BLOCK - 1) / BLOCK;
    uint16_t *last = NULL; /* the last, partial block's rows, zero-padded */
    if (blocks > full) {
        if ((last = calloc(BLOCK * K, sizeof(uint16_t))) == NULL) return 1;
        memcpy(last, w + full * BLOCK * K, (N - full * BLOCK) * K * sizeof(uint16_t));
    }
    _Pragma("omp parallel if (T * K * N >= 65536)") {
        float d[ROWS * BLOCK];
        const uint16_t *rows[ROWS];
        _Pragma("omp for schedule(static)") for (int64_t b = 0; b < blocks; b++) {
            const uint16_t *wb = b < full ? w + b * BLOCK * K : last;
            const int64_t width = b < full ? BLOCK : N - full * BLOCK;
            for (int64_t t0 = 0; t0 < T; t0 += ROWS) {
                const int64_t n = T - t0 < ROWS ? T - t0 : ROWS;
                for (int64_t r = 0; r < n; r++) rows[r] = x + (t0 + r) * K;
                block_sums(d, rows, n, wb, K, 0);
                for (int64_t r = 0; r < n; r++)
                    for (int64_t j = 0; j < width; j++)
                        out[(t0 + r) * N + b * BLOCK + j] = to_bf16(d[r * BLOCK + j] + (bias ? bias[b * BLOCK + j] : 0.0f));
            }
        }
    }
    free(last);
    return 0;
}

/* What K must be a multiple of. */
int linear_bf16_multiple(void) { return 2 * VL; }

/* Whether the products run on vdpbf16ps: only then is this kernel measured faster than oneDNN. */
int linear_bf16_native(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}
