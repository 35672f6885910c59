/*
 * y = x W^T + b in fp32 for Kiln's CPU plugin, with W laid out in tiles of 16
 * output features (see kiln_cpu/tiled_weights.py): fp32, or GGUF-style blocks.
 *
 * Within a tile the 16 features' values of one input position c lie together, so
 * W[n..n+8, c] is one vector and a row of x times it is a broadcast and an FMA:
 * the outer-product scheme of BLAS micro-kernels, with no cross-lane sums, and
 * 12 accumulators (16 features x 6 rows) to hide the FMA latency. Each output is
 * summed over K in order. Block formats are first widened to fp32, a tile at a
 * time (K x 16 floats, in L1/L2), and every 6 rows of x pass over it.
 *   fmt 32: q (N/16, K, 16) fp32.
 *   fmt 4:  q (N/16, K, 8) uint8: byte j holds feature j (low nibble) and j + 8
 *           (high); value = nibble * scale + min (GGUF's Q4_1).
 *   fmt 8:  q (N/16, K, 16) int8; value = q * scale (GGUF's Q8_0).
 *   scale, min: (N/16, K/32, 16) fp32, one per 32 input positions per feature.
 * Needs N % 16 == 0, and K % 32 == 0 for the block formats (the caller checks).
 */
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

#define TILE 16
#define ROWS 6

/* Tile t of a block-format W as fp32, (K, 16): tile[c * 16 + j] = W[16 t + j, c]. */
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

/* Tile t as fp32 (K, 16): in place for fmt 32, else widened into buf. */
static const float *tile_of(float *buf, int fmt, const float *scale, const float *min, const void *q, int64_t t,
                            int64_t K) {
    if (fmt == 32) return (const float *)q + t * K * TILE;
    widen_tile(buf, fmt, scale, min, q, t, K);
    return buf;
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

typedef void tile_fn(const float *tile, int64_t t, void *ctx);

/* Calls fn on every tile of W as fp32, tiles split over the threads; returns nonzero
 * when out of memory for the per-thread widening buffers. */
static int for_each_tile(int fmt, const float *scale, const float *min, const void *q, int64_t K, int64_t N,
                         tile_fn *fn, void *ctx) {
    int failed = 0;
    _Pragma("omp parallel") {
        float *buf = fmt == 32 ? NULL : malloc(K * TILE * sizeof(float));
        if (fmt != 32 && buf == NULL) failed = 1;
        _Pragma("omp for schedule(static)") for (int64_t t = 0; t < N / TILE; t++) {
            if (fmt == 32 || buf != NULL) fn(tile_of(buf, fmt, scale, min, q, t, K), t, ctx);
        }
        free(buf);
    }
    return failed;
}

struct linear_args {
    float *out;
    const float *x, *bias;
    int64_t rows, x_stride, K, N;
};

static void linear_tile(const float *tile, int64_t t, void *ctx) {
    const struct linear_args *a = ctx;
    for (int64_t r = 0; r < a->rows; r += ROWS)
        rows_times_tile(a->out, a->x, a->rows, a->x_stride, r, tile, a->bias, t * TILE, a->K, a->N);
}

/* out = x W^T + bias; nonzero when out of memory. */
int tiled_linear(float *out, const float *x, int64_t rows, int64_t x_stride, int fmt, const float *scale,
                 const float *min, const void *q, const float *bias, int64_t K, int64_t N) {
    struct linear_args args = {out, x, bias, rows, x_stride, K, N};
    return for_each_tile(fmt, scale, min, q, K, N, linear_tile, &args);
}

struct unpack_args {
    float *out;
    int64_t K;
};

static void unpack_tile(const float *tile, int64_t t, void *ctx) {
    const struct unpack_args *a = ctx;
    for (int j = 0; j < TILE; j++)
        for (int64_t c = 0; c < a->K; c++) a->out[(t * TILE + j) * a->K + c] = tile[c * TILE + j];
}

/* The whole of W as fp32 (N, K) rows; nonzero when out of memory. */
int tiled_unpack(float *out, int fmt, const float *scale, const float *min, const void *q, int64_t K, int64_t N) {
    struct unpack_args args = {out, K};
    return for_each_tile(fmt, scale, min, q, K, N, unpack_tile, &args);
}

/* Rows row_ids[0..n) of W as fp32 (embedding lookups). */
void tiled_gather_rows(float *out, const int64_t *row_ids, int64_t n, int fmt, const float *scale,
                       const float *min, const void *q, int64_t K) {
    const int64_t nb = K / 32;
    _Pragma("omp parallel for schedule(static)") for (int64_t i = 0; i < n; i++) {
        const int64_t t = row_ids[i] / TILE, j = row_ids[i] % TILE;
        float *row = out + i * K;
        if (fmt == 32) {
            const float *v = (const float *)q + t * K * TILE + j;
            for (int64_t c = 0; c < K; c++) row[c] = v[c * TILE];
        } else if (fmt == 4) {
            const float *d = scale + t * nb * TILE + j, *m = min + t * nb * TILE + j;
            for (int64_t c = 0; c < K; c++) {
                const uint8_t byte = ((const uint8_t *)q)[(t * K + c) * 8 + j % 8];
                row[c] = (float)(j < 8 ? byte & 15 : byte >> 4) * d[c / 32 * TILE] + m[c / 32 * TILE];
            }
        } else {
            const float *d = scale + t * nb * TILE + j;
            const int8_t *v = (const int8_t *)q + t * K * TILE + j;
            for (int64_t c = 0; c < K; c++) row[c] = (float)v[c * TILE] * d[c / 32 * TILE];
        }
    }
}
