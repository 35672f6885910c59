/*
 * fp32 y = x W^T + b for a decode step's few rows of x, for Kiln's CPU plugin.
 *
 * With few rows a linear layer is a stream through its weight: each weight value
 * is used once per row. BLAS sgemm tiles for the large-matrix case and, at 1-64
 * rows, ran at 4-8 GB/s of weight on this project's machines (memory gives ~20).
 * Here each thread takes tiles of 4 output features, whose 4 weight rows stay in
 * L1 while every pair of x rows passes over them: the weight is read from memory
 * once. A tile step is 4 features x 2 rows = 8 accumulators, one cross-lane sum.
 *
 * Needs in_features % 8 == 0 and out_features % 4 == 0 (the caller checks).
 */
#include <stdint.h>

#include "vec.h"

void small_linear_f32(float *out, const float *x, int64_t rows, int64_t x_stride, const float *w,
                      const float *bias, int64_t in_features, int64_t out_features) {
    const int64_t K = in_features;
    _Pragma("omp parallel for schedule(static)") for (int64_t n = 0; n < out_features; n += 4) {
        const float *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        /* The next tile's weights are fetched while this one computes (a cache line per step). */
        const char *next = (const char *)(w0 + 4 * K), *next_end = n + 8 <= out_features ? next + 16 * K : next;
        for (int64_t r = 0; r < rows; r += 2) {
            /* An odd last row is paired with itself; its duplicate is not stored. */
            const float *x0 = x + r * x_stride, *x1 = r + 1 < rows ? x0 + x_stride : x0;
            v8 a[8];
            for (int i = 0; i < 8; i++) a[i] = splat(0.0f);
            for (int64_t c = 0; c < K; c += 8) {
                if (next < next_end) __builtin_prefetch(next), next += 64;
                const v8 u = load8_f32(x0 + c), v = load8_f32(x1 + c);
                const v8 k0 = load8_f32(w0 + c), k1 = load8_f32(w1 + c);
                const v8 k2 = load8_f32(w2 + c), k3 = load8_f32(w3 + c);
                a[0] += k0 * u, a[1] += k0 * v, a[2] += k1 * u, a[3] += k1 * v;
                a[4] += k2 * u, a[5] += k2 * v, a[6] += k3 * u, a[7] += k3 * v;
            }
            float s[8];
            store8(s, sum_each8(a));  /* s[2 * feature + row] */
            for (int f = 0; f < 4; f++) {
                const float b = bias ? bias[n + f] : 0.0f;
                out[r * out_features + n + f] = s[2 * f] + b;
                if (r + 1 < rows) out[(r + 1) * out_features + n + f] = s[2 * f + 1] + b;
            }
        }
    }
}
