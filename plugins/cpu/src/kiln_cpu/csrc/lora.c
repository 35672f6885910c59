/*
 * Multi-LoRA on the CPU: every token's adapter update in one call per projection
 * (kiln.interfaces.lora.add_lora, BGMV-style: each token gathers its own slot's weights).
 *
 *   h = A[s] x[t]                       (num_slices * rank values; s = slots[t], < 0: none)
 *   y[t, off_i : off_i + n_i] += B[s, off_i : off_i + n_i, :] h[i * rank : (i + 1) * rank]  (+ bias)
 *
 * a: (num_slots, num_slices * rank, in), b: (num_slots, out, rank), bias: (num_slots, out)
 * or NULL, all fp32 and contiguous. Tokens are grouped by slot, so each slot's A and B are read
 * once per call (SGMV-style) rather than once per token: at decode batch sizes re-reading
 * them per token cost more than the products.
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

/* Four tokens' dot products with one weight row, which is loaded once for all four. */
static void dot4_f32(const float *w, const float *const x[4], int64_t n, float out[4]) {
    v8 a0 = splat(0.0f), a1 = splat(0.0f), a2 = splat(0.0f), a3 = splat(0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8 wv = load8_f32(w + i);
        a0 += wv * load8_f32(x[0] + i);
        a1 += wv * load8_f32(x[1] + i);
        a2 += wv * load8_f32(x[2] + i);
        a3 += wv * load8_f32(x[3] + i);
    }
    out[0] = hsum8(a0), out[1] = hsum8(a1), out[2] = hsum8(a2), out[3] = hsum8(a3);
    for (; i < n; i++)
        for (int j = 0; j < 4; j++) out[j] += w[i] * x[j][i];
}

/* The eight sums of v[0..7]'s lanes, as one vector (a transpose folded into the adds). */
static inline v8 hsum8x8(const v8 v[8]) {
#define EVEN(a, b) __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14)
#define ODD(a, b) __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15)
    const v8 p01 = EVEN(v[0], v[1]) + ODD(v[0], v[1]), p23 = EVEN(v[2], v[3]) + ODD(v[2], v[3]);
    const v8 p45 = EVEN(v[4], v[5]) + ODD(v[4], v[5]), p67 = EVEN(v[6], v[7]) + ODD(v[6], v[7]);
#undef EVEN
#undef ODD
    const v8 q03 = __builtin_shufflevector(p01, p23, 0, 1, 8, 9, 4, 5, 12, 13) +
                   __builtin_shufflevector(p01, p23, 2, 3, 10, 11, 6, 7, 14, 15);
    const v8 q47 = __builtin_shufflevector(p45, p67, 0, 1, 8, 9, 4, 5, 12, 13) +
                   __builtin_shufflevector(p45, p67, 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(q03, q47, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(q03, q47, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* y[0..8) += B[0..8) h (+ bias): eight rows of B (rank values each, row stride rank). */
static inline void expand8(float *y, const float *br, const float *hi, int64_t rank, const float *bias) {
    v8 acc[8];
    for (int k = 0; k < 8; k++) acc[k] = splat(0.0f);
    int64_t r = 0;
    for (; r + 8 <= rank; r += 8) {
        const v8 hv = load8_f32(hi + r);
        for (int k = 0; k < 8; k++) acc[k] += load8_f32(br + k * rank + r) * hv;
    }
    v8 sums = hsum8x8(acc);
    for (; r < rank; r++)
        for (int k = 0; k < 8; k++) sums[k] += br[k * rank + r] * hi[r];
    if (bias) sums += load8_f32(bias);
    store8(y, load8_f32(y) + sums);
}

#define LORA_TOKEN_CHUNK 16 /* tokens whose inputs stay in cache while A's rows pass over them */

int lora_add_f32(float *y, int64_t y_stride, const float *x, int64_t x_stride, int64_t tokens, const int64_t *slots,
                 const float *a, const float *b, const float *bias, int64_t in, int64_t out, int64_t rank,
                 int64_t num_slices, const int64_t *slice_sizes) {
    const int64_t h_len = num_slices * rank;
    int64_t num_slots = 0;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] + 1 > num_slots) num_slots = slots[t] + 1;
    if (num_slots == 0) return 0;
    /* Tokens grouped by slot (a counting sort): each slot's weights are read once per call. */
    int64_t *first = calloc(num_slots + 1, sizeof(int64_t)), *order = malloc(sizeof(int64_t) * tokens);
    float *h = malloc(sizeof(float) * tokens * h_len);
    if (first == NULL || order == NULL || h == NULL) {
        free(first), free(order), free(h);
        return 1;
    }
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= 0) first[slots[t] + 1]++;
    for (int64_t s = 0; s < num_slots; s++) first[s + 1] += first[s];
    for (int64_t s = 0, k = 0; s < num_slots; s++)
        for (int64_t t = 0; t < tokens; t++)
            if (slots[t] == s) order[k++] = t;
    const int64_t grouped = first[num_slots];
    const int64_t macs = grouped * (h_len * in + out * rank);
#pragma omp parallel if (macs >= LORA_PARALLEL_MIN_MACS)
    for (int64_t s = 0; s < num_slots; s++) {
        const int64_t n = first[s + 1] - first[s], base = first[s];
        if (n == 0) continue;
        const int64_t *idx = order + base;
        const float *as = a + s * h_len * in, *bs = b + s * out * rank, *bias_s = bias ? bias + s * out : NULL;
        const int64_t chunks = (n + LORA_TOKEN_CHUNK - 1) / LORA_TOKEN_CHUNK;
        /* shrink: h[token] = A[s] x[token], a chunk of tokens per pass over A's rows */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < chunks * h_len; task++) {
            const int64_t c = task / h_len, r = task % h_len, end = c * LORA_TOKEN_CHUNK + LORA_TOKEN_CHUNK;
            const float *ar = as + r * in;
            int64_t j = c * LORA_TOKEN_CHUNK;
            for (; j + 4 <= n && j + 4 <= end; j += 4) {
                const float *xs[4] = {x + idx[j] * x_stride, x + idx[j + 1] * x_stride, x + idx[j + 2] * x_stride,
                                      x + idx[j + 3] * x_stride};
                float d[4];
                dot4_f32(ar, xs, in, d);
                for (int q = 0; q < 4; q++) h[(base + j + q) * h_len + r] = d[q];
            }
            for (; j < n && j < end; j++) h[(base + j) * h_len + r] = dot_f32(ar, x + idx[j] * x_stride, in);
        }
        /* expand: y[token, row] += B[s, row] h[token, slice of row] (+ bias), eight rows at a time */
        const int64_t blocks = (out + 7) / 8;
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++) {
            for (int64_t row = blk * 8, stop = row + 8 < out ? row + 8 : out; row < stop;) {
                int64_t i = 0, edge = slice_sizes[0];
                while (row >= edge) edge += slice_sizes[++i];
                if (row + 8 <= edge && row + 8 <= stop) { /* eight rows of one slice */
                    for (int64_t j = 0; j < n; j++)
                        expand8(y + idx[j] * y_stride + row, bs + row * rank, h + (base + j) * h_len + i * rank,
                                rank, bias_s ? bias_s + row : NULL);
                    row += 8;
                    continue;
                }
                const float add = bias_s ? bias_s[row] : 0.0f;
                for (int64_t j = 0; j < n; j++)
                    y[idx[j] * y_stride + row] += dot_f32(bs + row * rank, h + (base + j) * h_len + i * rank, rank) + add;
                row++;
            }
        }
    }
    free(first), free(order), free(h);
    return 0;
}
