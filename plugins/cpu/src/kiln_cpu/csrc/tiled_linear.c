/*
 * y = x W^T + b in fp32 for Kiln's CPU plugin, with W laid out in tiles of 16
 * output features (see kiln_cpu/tiled_weights.py): fp32, or GGUF-style blocks.
 *
 * Within a tile the 16 features' values of one input position c lie together, so
 * W[n..n+8, c] is one vector and a row of x times it is a broadcast and an FMA:
 * the outer-product scheme of BLAS micro-kernels, with no cross-lane sums, and up to
 * 12 accumulators (16 features x 6 rows) to hide the FMA latency. Each output is
 * summed over K in order. Block formats are first widened to fp32, a tile at a
 * time (K x 16 floats, in L1/L2), and every 6 rows of x pass over it; bf16 tiles too
 * where more than 6 rows pass (fewer widen as they read, see tiled.h).
 *   fmt 32: q (N/16, K, 16) fp32; fmt 16: the same in bf16 (fp32 values that bf16 holds
 *           exactly, e.g. a bf16 checkpoint's weights served in fp32: half the bytes).
 *   fmt 4:  value = nibble * scale + min (GGUF's Q4_1); fmt 8: value = int8 * scale
 *           (Q8_0), + min where there is one (Q5_1, Q5_K); fmt 6: fmt 8 with a scale per
 *           16 inputs (Q6_K); their bytes lie as int8_linear.c describes.
 *   scale, min: (N/16, K/32, 16) fp32, one per 32 input positions per feature (fmt 6's
 *           scale: (N/16, K/16, 16); fmt 6 with a min: rows of mixed types, see gguf_blocks.py);
 *           fp16 where fmt has F16_SCALES (vec.h).
 * Needs N % 16 == 0, and K % 32 == 0 for the block formats (the caller checks).
 */
#include <stdint.h>
#include <stdlib.h>

#include "tiled.h"
#include "vec.h"

#define ROWS TILE_ROWS

/* Tile t of a block-format W as fp32, (K, 16): tile[c * 16 + j] = W[16 t + j, c]. Lane j
 * of a 32-byte load holds 4 inputs of feature j (of 8); shifts pick out byte i. */
static void widen_tile(float *tile, int fmt, const float *scale, const float *min, const void *q, int64_t t,
                       int64_t K) {
    const int64_t nb = K / 32;
    const int subs = scales_per_block(fmt), f16 = fmt & F16_SCALES;
    fmt = block_fmt(fmt);
    for (int64_t b = 0; b < nb; b++) {
        float *blk = tile + b * 32 * TILE;
        for (int h = 0; h < 2; h++) {
            for (int g = 0; g < (fmt == 4 ? 4 : 8); g++) {
                const int64_t at = ((t * nb + b) * subs + g * subs / 8) * TILE + 8 * h;
                const v8 d = load8_scale(scale, at, f16);
                const v8 m = min ? load8_scale(min, (t * nb + b) * TILE + 8 * h, f16) : splat(0.0f);
                i8 lanes;
                memcpy(&lanes, (const uint8_t *)q + (t * nb + b) * (fmt == 4 ? 256 : 512) + g * 64 + h * 32, 32);
                for (int i = 0; i < 4; i++) {
                    if (fmt == 4) {
                        const i8 byte = (lanes >> (8 * i)) & 255;
                        store8(blk + (4 * g + i) * TILE + 8 * h, __builtin_convertvector(byte & 15, v8) * d + m);
                        store8(blk + (16 + 4 * g + i) * TILE + 8 * h, __builtin_convertvector(byte >> 4, v8) * d + m);
                    } else {
                        const i8 byte = (lanes << (24 - 8 * i)) >> 24; /* sign-extended */
                        store8(blk + (4 * g + i) * TILE + 8 * h, __builtin_convertvector(byte, v8) * d + m);
                    }
                }
            }
        }
    }
}

/* bf16 tiles are read in place, widened as read, by passes of up to this many rows in all; more widen
 * the tile into fp32 first. With AVX-512 (a widening of 16 values per 12 rows' FMAs) reading in place
 * was faster at every row count tried on a 2-core Xeon (16 rows of a bf16 1536x576 projection: 0.13
 * against 0.20 ms; 128: 0.82 against 0.93); with AVX2 (8 values per 6 rows' FMAs) for two passes and
 * no more (64 rows: 0.87 against 0.69 ms). */
#define BF16_IN_PLACE_ROWS (VL == 16 ? INT64_MAX : 2 * ROWS)

int tile_widens(int fmt, int64_t rows) { return fmt != 32 && !(fmt == 16 && rows <= BF16_IN_PLACE_ROWS); }

Tile tile_of(float *buf, int fmt, const float *scale, const float *min, const void *q, int64_t t, int64_t K,
             int64_t rows) {
    if (fmt == 32) return (Tile){(const float *)q + t * K * TILE, 0, NULL};
    if (fmt == 16) {
        const uint16_t *v = (const uint16_t *)q + t * K * TILE;
        if (!tile_widens(fmt, rows)) return (Tile){v, 1, NULL};
        for (int64_t i = 0; i < K * TILE; i++) buf[i] = from_bf16(v[i]);
    } else {
        widen_tile(buf, fmt, scale, min, q, t, K);
    }
    return (Tile){buf, 0, NULL};
}

/* The tile kernel for R rows of x (a literal R each: one row must not pay for twelve), for fp32
 * tiles and for bf16 ones widened as they are read, over T tiles (1, 2 or 4, literal: the tile
 * and those that follow it in memory). A row's 16 sums are TILE / VL vectors; on
 * AVX-512 one zmm each, where ymm pairs left half the FMA width unused: on a 2-core AVX-512 Xeon,
 * 128 rows of a 1536x576 fp32 projection went from 84 to 139-156 GMAC/s (torch's GEMM: 161-185),
 * 16 rows of a 49152x512 LM head from 5.2 to 3.5-3.9 ms. A pair has each broadcast of x feed two
 * FMAs: with one zmm a row, every FMA took a load of its own (the broadcast) beside the weight's,
 * and the loads, not the FMAs, set the pace (see tiled_linear). */
static inline __attribute__((always_inline)) void rows_times(float *out, const float *x, int64_t x_stride, int64_t r,
                                                             Tile tile, const float *bias, int64_t n, int64_t K,
                                                             int64_t N, const int R, const int T) {
    enum { V = TILE / VL };
    const float *f = tile.p;
    const uint16_t *h = tile.p;
    const char *ahead = tile.ahead;
    const int64_t lines = (tile.bf16 ? K / 2 : K) * T; /* of the tiles ahead, of these ones' type */
    vf a[ROWS * 2 * V]; /* row i's sums at i * T * V: R * T <= 2 * ROWS */
    for (int i = 0; i < R * T * V; i++) a[i] = splatf(0.0f);
    for (int64_t c = 0; c < K; c++) {
        /* a pair's next tiles into L2, not L1, which the pair and the rows fill: the default model's
         * 120 fp32 projections at 16 rows from memory took 26.5-28.4 ms a step, 28.9-30.0 into L1 */
        for (int s = 0; s < T; s++)
            if (ahead && c * T + s < lines) __builtin_prefetch(ahead + (c * T + s) * 64, 0, T > 1 ? 2 : 3);
        /* A pass that asks for no tiles ahead (a single pass: a decode step of a few rows; or one
         * before the last) asks for its own tiles' lines STREAM_AHEAD bytes on, one a line (after
         * the first pass, lines in cache already): with few FMA chains to a row, too few loads were in
         * flight for memory's latency, and bf16 tiles (half the bytes an FMA) streamed at 16-19 GB/s
         * where the machine gives ~27 (2-core Xeon). (A tile widened into a buffer is in cache
         * already; the asks cost an instruction a line there.) */
        if (!ahead && (!tile.bf16 || c % 2 == 0))
            for (int s = 0; s < T; s++)
                __builtin_prefetch((const char *)tile.p + (s * K * TILE + c * TILE) * (tile.bf16 ? 2 : 4) + STREAM_AHEAD, 0, 3);
        vf w[4 * V];
        for (int s = 0; s < T; s++)
            for (int v = 0; v < V; v++) {
                const int64_t at = s * K * TILE + c * TILE + v * VL;
                w[s * V + v] = tile.bf16 ? loadf_bf16(h + at) : loadf(f + at);
            }
        for (int i = 0; i < R; i++) {
            const vf xi = splatf(x[(r + i) * x_stride + c]);
            for (int v = 0; v < T * V; v++) a[i * T * V + v] += w[v] * xi;
        }
    }
    for (int v = 0; v < T * V; v++) {
        const vf b = bias ? loadf(bias + n + v * VL) : splatf(0.0f);
        for (int i = 0; i < R; i++) storef(out + (r + i) * N + n + v * VL, a[i * T * V + v] + b);
    }
}

/* The loops over R unroll only with R known: one copy per R, tile type and count. */
#define PASS(R)                                                                                       \
    case R:                                                                                           \
        if (VL == 16 && R <= 4 && count == 4 && tile.bf16)                                            \
            rows_times(out, x, x_stride, r, (Tile){tile.p, 1, tile.ahead}, bias, n, K, N, R, 4);       \
        else if (VL == 16 && R <= 4 && count == 4)                                                    \
            rows_times(out, x, x_stride, r, (Tile){tile.p, 0, tile.ahead}, bias, n, K, N, R, 4);       \
        else if ((VL == 16 || R <= 2) && count == 2 && tile.bf16)                                     \
            rows_times(out, x, x_stride, r, (Tile){tile.p, 1, tile.ahead}, bias, n, K, N, R, 2);       \
        else if ((VL == 16 || R <= 2) && count == 2)                                                  \
            rows_times(out, x, x_stride, r, (Tile){tile.p, 0, tile.ahead}, bias, n, K, N, R, 2);       \
        else if (tile.bf16)                                                                           \
            rows_times(out, x, x_stride, r, (Tile){tile.p, 1, tile.ahead}, bias, n, K, N, R, 1);       \
        else                                                                                          \
            rows_times(out, x, x_stride, r, (Tile){tile.p, 0, tile.ahead}, bias, n, K, N, R, 1);       \
        break;

/* rows_times over tile t and the count - 1 after it (out's features n..n+16 count). */
static void rows_times_tiles(float *out, const float *x, int64_t rows, int64_t x_stride, int64_t r, Tile tile,
                             const float *bias, int64_t n, int64_t K, int64_t N, int count) {
    switch (rows - r < ROWS ? rows - r : ROWS) {
        PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6)
#if TILE_ROWS > 6
        PASS(7) PASS(8) PASS(9) PASS(10) PASS(11) PASS(12)
#endif
    }
}

void rows_times_tile(float *out, const float *x, int64_t rows, int64_t x_stride, int64_t r, Tile tile,
                     const float *bias, int64_t n, int64_t K, int64_t N) {
    rows_times_tiles(out, x, rows, x_stride, r, tile, bias, n, K, N, 1);
}

typedef void tile_fn(Tile tile, int64_t t, void *ctx);

/* Calls fn on every tile of W as tile_of gives it for that many rows, tiles split over the
 * threads; returns nonzero when out of memory for the per-thread widening buffers. */
static int for_each_tile(int fmt, const float *scale, const float *min, const void *q, int64_t K, int64_t N,
                         int64_t rows, tile_fn *fn, void *ctx) {
    int failed = 0;
    _Pragma("omp parallel") {
        const int widens = tile_widens(fmt, rows);
        float *buf = widens ? malloc(K * TILE * sizeof(float)) : NULL;
        if (widens && buf == NULL) failed = 1;
        _Pragma("omp for schedule(static)") for (int64_t t = 0; t < N / TILE; t++) {
            if (!widens || buf != NULL) fn(tile_of(buf, fmt, scale, min, q, t, K, rows), t, ctx);
        }
        free(buf);
    }
    return failed;
}

struct linear_args {
    float *out;
    const float *x, *bias;
    int64_t rows, x_stride, K, N;
    const char *ahead; /* tiles read in place by more than one pass (see linear_tiles), else NULL */
};

/* Tile t and the next `count - 1` (one, two or four tiles; more than one only read in place) for every row. */
static void linear_tiles(Tile tile, int64_t t, int count, const struct linear_args *a) {
    /* With more rows than one pass takes, the last pass over a tile (read from L1 by then) also
     * asks for the thread's next tile, so that the next first pass does not wait on memory: 16 rows
     * of a bf16-tiled 49152x512 LM head from memory took 5.1-5.8 ms, 5.8-6.6 without (and 6.0
     * without against 4.1-4.5 with for fp32 tiles, asked for in the first pass then). One pass (a
     * decode step of a few sequences) streams a tile once, and asking ahead only slowed it. */
    Tile last = tile;
    if (a->ahead && t + count < a->N / TILE) last.ahead = a->ahead + (t + count) * a->K * TILE * (tile.bf16 ? 2 : 4);
    /* passes of even sizes: 16 rows as 8 and 8, not 12 and 4 (four FMA chains wait on their latency) */
    for (int64_t r = 0, passes = (a->rows + ROWS - 1) / ROWS; r < a->rows; passes--) {
        const int64_t size = (a->rows - r + passes - 1) / passes;
        const Tile pass = r + size < a->rows ? tile : last;
        rows_times_tiles(a->out, a->x, r + size, a->x_stride, r, pass, a->bias, t * TILE, a->K, a->N, count);
        r += size;
    }
}

static void linear_tile(Tile tile, int64_t t, void *ctx) { linear_tiles(tile, t, 1, ctx); }

/* out = x W^T + bias; nonzero when out of memory. Tiles read in place go two at a time where a
 * row's 16 sums are one register (AVX-512): 16 rows of a 49152x512 fp32 LM head in cache took
 * 4.3 ms one tile at a time, at ~100 GMAC/s of the ~220 that two cores' FMAs allow (see
 * rows_times). Up to 4 rows take them four at a time there, and up to 2 rows two at a time on
 * AVX2, so that each row has 4 FMA chains or more: with 2 (a row of a pair), a decode step of one
 * or two sequences waited on the FMAs' latency. With the stream prefetch of rows_times, a 1024x2048
 * projection from memory went from 225-235 to 181-228 us for one row in bf16 tiles, 369-412 to
 * 292-364 for four in fp32 (2-core Xeon, alternated); under AVX2 335-360 to 231-252 and 404-413 to 305 for one. */
int tiled_linear(float *out, const float *x, int64_t rows, int64_t x_stride, int fmt, const float *scale,
                 const float *min, const void *q, const float *bias, int64_t K, int64_t N) {
    const int in_place = fmt == 32 || !tile_widens(fmt, rows);
    struct linear_args args = {out, x, bias, rows, x_stride, K, N, in_place && rows > ROWS ? q : NULL};
    const int64_t tiles = N / TILE;
    const int64_t g = VL == 16 && rows <= 4 && tiles % 4 == 0 ? 4 : 2; /* tiles a group */
    if ((VL == 16 || rows <= 2) && in_place && tiles > 1) {
        _Pragma("omp parallel for schedule(static)") for (int64_t p = 0; p < (tiles + g - 1) / g; p++)
            linear_tiles(tile_of(NULL, fmt, scale, min, q, g * p, K, rows), g * p, g * p + g - 1 < tiles ? g : 1, &args);
        return 0;
    }
    return for_each_tile(fmt, scale, min, q, K, N, rows, linear_tile, &args);
}

struct unpack_args {
    float *out;
    int64_t K;
};

static void unpack_tile(Tile tile, int64_t t, void *ctx) {
    const struct unpack_args *a = ctx;
    const float *f = tile.p;
    const uint16_t *h = tile.p;
    for (int j = 0; j < TILE; j++)
        for (int64_t c = 0; c < a->K; c++)
            a->out[(t * TILE + j) * a->K + c] = tile.bf16 ? from_bf16(h[c * TILE + j]) : f[c * TILE + j];
}

/* The whole of W as fp32 (N, K) rows; nonzero when out of memory. */
int tiled_unpack(float *out, int fmt, const float *scale, const float *min, const void *q, int64_t K, int64_t N) {
    struct unpack_args args = {out, K};
    return for_each_tile(fmt, scale, min, q, K, N, 1, unpack_tile, &args); /* 1: bf16 tiles read in place */
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
            continue;
        }
        if (fmt == 16) {
            const uint16_t *v = (const uint16_t *)q + t * K * TILE + j;
            for (int64_t c = 0; c < K; c++) row[c] = from_bf16(v[c * TILE]);
            continue;
        }
        const int subs = scales_per_block(fmt), f16 = fmt & F16_SCALES;
        for (int64_t c = 0; c < K; c++) {
            const int64_t b = c / 32, in = c % 32, at = ((t * nb + b) * subs + in * subs / 32) * TILE + j;
            const float m = min ? scale_at(min, (t * nb + b) * TILE + j, f16) : 0.0f, d = scale_at(scale, at, f16);
            if (block_fmt(fmt) == 4) {
                const int64_t g = (in % 16) / 4;
                const uint8_t byte = ((const uint8_t *)q)[(t * nb + b) * 256 + (g * TILE + j) * 4 + in % 4];
                row[c] = (float)(in < 16 ? byte & 15 : byte >> 4) * d + m;
            } else {
                const int8_t v = ((const int8_t *)q)[(t * nb + b) * 512 + (in / 4 * TILE + j) * 4 + in % 4];
                row[c] = (float)v * d + m;
            }
        }
    }
}
