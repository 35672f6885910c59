/*
 * y = x W^T + b with W in GGUF-style blocks (see kiln_cpu/gguf_weights.py), for
 * Kiln's CPU plugin, at any number of rows of x. Each thread widens a tile of 16
 * output features to fp32 (K x 16 floats, in L1/L2) and passes every 6 rows of x
 * over it; the results are those of the fp32 weight, summed over K in order.
 *
 * Layout: output features in tiles of 16; within a tile the 16 features' values
 * of one input position c lie together, so widening 8 bytes gives the fp32 vector
 * W[n..n+8, c] and one row of x times it is a broadcast and an FMA (the
 * outer-product scheme of BLAS micro-kernels: no cross-lane sums, and 12
 * accumulators for 16 features x 6 rows hide the FMA latency).
 *   q4: q (N/16, K, 8) uint8: byte j holds feature j (low nibble) and j + 8 (high);
 *       value = nibble * scale + min.
 *   q8: q (N/16, K, 16) int8; value = q * scale.
 *   scale, min: (N/16, K/32, 16) fp32, one per 32 input positions per feature.
 * Needs K % 32 == 0 and N % 16 == 0 (the caller checks).
 */
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

#define TILE 16
#define ROWS 6

/* Tile t of W as fp32, (K, 16): tile[c * 16 + j] = W[16 t + j, c]. */
static void widen_tile(float *tile, int fmt, const float *scale, const float *min, const void *q, int64_t t,
                       int64_t K) {
    const int64_t nb = K / 32;
    scale += t * nb * TILE;
    if (fmt == 4) {
        min += t * nb * TILE;
        const uint8_t *p = (const uint8_t *)q + t * K * 8;
        for (int64_t b = 0; b < nb; b++) {
            const v8 d0 = load8_f32(scale + b * TILE), d1 = load8_f32(scale + b * TILE + 8);
            const v8 m0 = load8_f32(min + b * TILE), m1 = load8_f32(min + b * TILE + 8);
            for (int64_t c = b * 32; c < b * 32 + 32; c++) {
                const i8 bytes = load8_u8(p + c * 8);
                store8(tile + c * TILE, __builtin_convertvector(bytes & 15, v8) * d0 + m0);
                store8(tile + c * TILE + 8, __builtin_convertvector(bytes >> 4, v8) * d1 + m1);
            }
        }
    } else {
        const int8_t *p = (const int8_t *)q + t * K * TILE;
        for (int64_t b = 0; b < nb; b++) {
            const v8 d0 = load8_f32(scale + b * TILE), d1 = load8_f32(scale + b * TILE + 8);
            for (int64_t c = b * 32; c < b * 32 + 32; c++) {
                store8(tile + c * TILE, __builtin_convertvector(load8_s8(p + c * TILE), v8) * d0);
                store8(tile + c * TILE + 8, __builtin_convertvector(load8_s8(p + c * TILE + 8), v8) * d1);
            }
        }
    }
}

/* out[r, n..n+16] for up to ROWS rows from r; missing rows repeat row r and are not stored. */
static void rows_times_tile(float *out, const float *x, int64_t rows, int64_t x_stride, int64_t r,
                            const float *tile, const float *bias, int64_t n, int64_t K, int64_t N) {
    const float *xr[ROWS];
    for (int i = 0; i < ROWS; i++) xr[i] = x + (r + i < rows ? r + i : r) * x_stride;
    v8 a[ROWS][2];
    for (int i = 0; i < ROWS; i++) a[i][0] = a[i][1] = splat(0.0f);
    for (int64_t c = 0; c < K; c++) {
        const v8 w0 = load8_f32(tile + c * TILE), w1 = load8_f32(tile + c * TILE + 8);
        for (int i = 0; i < ROWS; i++) {
            const v8 xi = splat(xr[i][c]);
            a[i][0] += w0 * xi, a[i][1] += w1 * xi;
        }
    }
    const v8 b0 = bias ? load8_f32(bias + n) : splat(0.0f), b1 = bias ? load8_f32(bias + n + 8) : splat(0.0f);
    for (int i = 0; i < ROWS && r + i < rows; i++) {
        store8(out + (r + i) * N + n, a[i][0] + b0);
        store8(out + (r + i) * N + n + 8, a[i][1] + b1);
    }
}

/* Returns nonzero when out of memory for the per-thread tile buffers. */
int gguf_linear(float *out, const float *x, int64_t rows, int64_t x_stride, int fmt, const float *scale,
                const float *min, const void *q, const float *bias, int64_t K, int64_t N) {
    int failed = 0;
    _Pragma("omp parallel") {
        float *tile = malloc(K * TILE * sizeof(float));
        if (tile == NULL) failed = 1;
        _Pragma("omp for schedule(static)") for (int64_t t = 0; t < N / TILE; t++) {
            if (tile == NULL) continue;
            widen_tile(tile, fmt, scale, min, q, t, K);
            for (int64_t r = 0; r < rows; r += ROWS)
                rows_times_tile(out, x, rows, x_stride, r, tile, bias, t * TILE, K, N);
        }
        free(tile);
    }
    return failed;
}

/* The whole of W as fp32 (N, K) rows; nonzero when out of memory. */
int gguf_unpack(float *out, int fmt, const float *scale, const float *min, const void *q, int64_t K, int64_t N) {
    int failed = 0;
    _Pragma("omp parallel") {
        float *tile = malloc(K * TILE * sizeof(float));
        if (tile == NULL) failed = 1;
        _Pragma("omp for schedule(static)") for (int64_t t = 0; t < N / TILE; t++) {
            if (tile == NULL) continue;
            widen_tile(tile, fmt, scale, min, q, t, K);
            for (int j = 0; j < TILE; j++)
                for (int64_t c = 0; c < K; c++) out[(t * TILE + j) * K + c] = tile[c * TILE + j];
        }
        free(tile);
    }
    return failed;
}

/* Rows row_ids[0..n) of W as fp32 (embedding lookups). */
void gguf_gather_rows(float *out, const int64_t *row_ids, int64_t n, int fmt, const float *scale,
                      const float *min, const void *q, int64_t K) {
    const int64_t nb = K / 32;
    _Pragma("omp parallel for schedule(static)") for (int64_t i = 0; i < n; i++) {
        const int64_t t = row_ids[i] / TILE, j = row_ids[i] % TILE;
        const float *d = scale + t * nb * TILE + j;
        for (int64_t c = 0; c < K; c++) {
            float v;
            if (fmt == 4) {
                const uint8_t byte = ((const uint8_t *)q)[(t * K + c) * 8 + j % 8];
                v = (float)(j < 8 ? byte & 15 : byte >> 4) * d[c / 32 * TILE] + min[t * nb * TILE + j + c / 32 * TILE];
            } else {
                v = (float)((const int8_t *)q)[(t * K + c) * TILE + j] * d[c / 32 * TILE];
            }
            out[i * K + c] = v;
        }
    }
}
