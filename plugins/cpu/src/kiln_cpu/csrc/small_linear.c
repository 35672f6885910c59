/*
 * y = x W^T + b for a decode step's few rows of x, for Kiln's CPU plugin, with W
 * in fp32 or packed as 4- or 8-bit integers with a float scale per 32 values.
 *
 * With few rows a linear layer is a stream through its weight: each weight value
 * is used once per row. BLAS sgemm tiles for the large-matrix case and, at 1-64
 * rows, ran at 4-8 GB/s of weight on this project's machines (memory gives ~20).
 * Here each thread takes tiles of 4 output features, whose 4 weight rows stay in
 * L1 while every pair of x rows passes over them: the weight is read from memory
 * once. A tile step is 4 features x 2 rows = 8 accumulators, one cross-lane sum.
 * A packed tile is first widened to fp32 in a per-thread buffer, so its products
 * and sums are exactly those of the fp32 weight it came from.
 *
 * Packed formats (rows of K values, blocks of 32; see kiln_cpu/packed_weights.py):
 *   q4: value = nibble * scale + min; byte j of a block holds values j (low
 *       nibble) and j + 16 (high nibble). The layout of GGUF's Q4_1.
 *   q8: value = int8 * scale. The values of GGUF's Q8_0.
 *
 * Needs in_features % 32 == 0 (packed) or % 8 == 0 (fp32) and out_features % 4
 * == 0 (the caller checks).
 */
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

/* Output features n..n+3 for every row, from weight rows w0..w3. While the first
 * row pair runs, the bytes [next, next_end) (the next tile) are prefetched. */
static void tile4(float *out, const float *x, int64_t rows, int64_t x_stride, const float *w0, const float *bias,
                  int64_t n, int64_t K, int64_t out_features, const char *next, const char *next_end) {
    const float *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
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
        store8(s, sum_each8(a)); /* s[2 * feature + row] */
        for (int f = 0; f < 4; f++) {
            const float b = bias ? bias[n + f] : 0.0f;
            out[r * out_features + n + f] = s[2 * f] + b;
            if (r + 1 < rows) out[(r + 1) * out_features + n + f] = s[2 * f + 1] + b;
        }
    }
}

void small_linear_f32(float *out, const float *x, int64_t rows, int64_t x_stride, const float *w,
                      const float *bias, int64_t in_features, int64_t out_features) {
    const int64_t K = in_features;
    _Pragma("omp parallel for schedule(static)") for (int64_t n = 0; n < out_features; n += 4) {
        const char *next = (const char *)(w + (n + 4) * K);
        tile4(out, x, rows, x_stride, w + n * K, bias, n, K, out_features, next,
              n + 8 <= out_features ? next + 16 * K : next);
    }
}

static void widen_q4(float *restrict out, const float *scale, const float *min, const uint8_t *restrict q,
                     int64_t K) {
    for (int64_t b = 0; b < K / 32; b++, out += 32, q += 16) {
        const v8 d = splat(scale[b]), m = splat(min[b]);
        for (int h = 0; h < 16; h += 8) {
            const i8 packed = load8_u8(q + h);
            store8(out + h, __builtin_convertvector(packed & 15, v8) * d + m);
            store8(out + h + 16, __builtin_convertvector(packed >> 4, v8) * d + m);
        }
    }
}

static void widen_q8(float *restrict out, const float *scale, const int8_t *restrict q, int64_t K) {
    for (int64_t b = 0; b < K / 32; b++, out += 32, q += 32) {
        const v8 d = splat(scale[b]);
        for (int h = 0; h < 32; h += 8) store8(out + h, __builtin_convertvector(load8_s8(q + h), v8) * d);
    }
}

/* Row `row` of a packed weight (fmt 4: q4, 8: q8) as K floats. */
static void widen_row(float *out, int fmt, const float *scale, const float *min, const void *q, int64_t row,
                      int64_t K) {
    if (fmt == 4)
        widen_q4(out, scale + row * (K / 32), min + row * (K / 32), (const uint8_t *)q + row * (K / 2), K);
    else
        widen_q8(out, scale + row * (K / 32), (const int8_t *)q + row * K, K);
}

/* small_linear_f32 on a packed weight; returns nonzero when out of memory. */
int small_linear_packed(float *out, const float *x, int64_t rows, int64_t x_stride, int fmt, const float *scale,
                        const float *min, const void *q, const float *bias, int64_t in_features,
                        int64_t out_features) {
    const int64_t K = in_features;
    int failed = 0;
    _Pragma("omp parallel") {
        float *tile = malloc(4 * K * sizeof(float));
        if (tile == NULL) failed = 1;
        _Pragma("omp for schedule(static)") for (int64_t n = 0; n < out_features; n += 4) {
            if (tile == NULL) continue;
            for (int f = 0; f < 4; f++) widen_row(tile + f * K, fmt, scale, min, q, n + f, K);
            tile4(out, x, rows, x_stride, tile, bias, n, K, out_features, NULL, NULL);
        }
        free(tile);
    }
    return failed;
}

/* Rows row_ids[0..n) of a packed weight (all rows in order when row_ids is NULL) into out. */
void unpack_rows(float *out, const int64_t *row_ids, int64_t n, int fmt, const float *scale, const float *min,
                 const void *q, int64_t K) {
    _Pragma("omp parallel for schedule(static)") for (int64_t i = 0; i < n; i++)
        widen_row(out + i * K, fmt, scale, min, q, row_ids ? row_ids[i] : i, K);
}
