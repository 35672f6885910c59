/*
 * Multi-LoRA on the CPU: every token's adapter update in one call per projection
 * (kiln.interfaces.lora.add_lora, BGMV-style: each token gathers its own slot's weights).
 *
 *   h = A[s] x[t]                       (num_slices * rank values; s = slots[t], < 0: none)
 *   y[t, off_i : off_i + n_i] += B[s, off_i : off_i + n_i, :] h[i * rank : (i + 1) * rank]  (+ bias)
 *
 * a: (num_slots, num_slices * rank, in), b: (num_slots, out, rank), bias: (num_slots, out)
 * or NULL, all fp32 and contiguous. Tokens run in parallel; each reads its slot's A and B,
 * which stay in cache across the tokens of one request.
 */
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

#define LORA_PARALLEL_MIN_MACS 65536

static float dot_f32(const float *a, const float *b, int64_t n) {
    v8 acc0 = splat(0.0f), acc1 = splat(0.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 += load8_f32(a + i) * load8_f32(b + i);
        acc1 += load8_f32(a + i + 8) * load8_f32(b + i + 8);
    }
    for (; i + 8 <= n; i += 8) acc0 += load8_f32(a + i) * load8_f32(b + i);
    float sum = hsum8(acc0 + acc1);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

int lora_add_f32(float *y, int64_t y_stride, const float *x, int64_t x_stride, int64_t tokens, const int64_t *slots,
                 const float *a, const float *b, const float *bias, int64_t in, int64_t out, int64_t rank,
                 int64_t num_slices, const int64_t *slice_sizes) {
    const int64_t h_len = num_slices * rank;
    const int64_t macs = tokens * (h_len * in + out * rank);
    int failed = 0;
#pragma omp parallel if (macs >= LORA_PARALLEL_MIN_MACS)
    {
        float *h = malloc(sizeof(float) * (size_t)h_len);
        if (h == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) {
            const int64_t s = slots[t];
            if (s < 0 || h == NULL) continue;
            const float *xt = x + t * x_stride;
            const float *as = a + s * h_len * in;
            for (int64_t r = 0; r < h_len; r++) h[r] = dot_f32(as + r * in, xt, in);
            float *yt = y + t * y_stride;
            const float *bs = b + s * out * rank;
            const float *bias_s = bias ? bias + s * out : NULL;
            int64_t row = 0;
            for (int64_t i = 0; i < num_slices; i++) {
                const float *hi = h + i * rank;
                for (int64_t end = row + slice_sizes[i]; row < end; row++) {
                    yt[row] += dot_f32(bs + row * rank, hi, rank) + (bias_s ? bias_s[row] : 0.0f);
                }
            }
        }
        free(h);
    }
    return failed;
}
