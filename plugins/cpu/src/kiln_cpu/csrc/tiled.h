/*
 * The tile kernels of tiled_linear.c (and int8_linear.c's matmul) that other kernels of this
 * library build on (see there for the weight formats).
 */
#ifndef KILN_TILED_H
#define KILN_TILED_H
#include <stdint.h>

#include "vec.h"

#define TILE 16 /* output features per tile */
/* Rows of x per pass over a tile: a row's 16 sums are two ymm accumulators, or one zmm (AVX-512's
 * 32 registers, and eight or more chains hide the FMA latency). */
#define TILE_ROWS (VL == 16 ? 12 : 6)

/* A tile of a weight, (K, 16) values, as rows_times_tile reads it: fp32, or bf16 widened as read. */
typedef struct {
    const void *p;
    int bf16;
    const void *ahead; /* or NULL: the tile read next (of this one's type), prefetched as this one is read */
} Tile;

/* Tile t of a weight for `rows` rows of x: in place for fmt 32; fmt 16 (bf16) in place for any
 * rows with AVX-512, up to two passes of TILE_ROWS with AVX2 (widening as it reads beats widening
 * first there: a bf16 1536x576 projection for one row took 36 us against 91), else widened to fp32
 * into buf (K * 16 floats), as the block formats always are. tile_widens says whether it needs buf. */
int tile_widens(int fmt, int64_t rows);
Tile tile_of(float *buf, int fmt, const float *scale, const float *min, const void *q, int64_t t, int64_t K,
             int64_t rows);

/* out[r + i, n..n+16] (row stride N) = x[r + i] . tile (+ bias[n..]) for up to TILE_ROWS rows from
 * r of rows; needs r < rows. Each output is summed over K in order, whatever the vector width. */
void rows_times_tile(float *out, const float *x, int64_t rows, int64_t x_stride, int64_t r, Tile tile,
                     const float *bias, int64_t n, int64_t K, int64_t N);

/* out = x W^T + bias in fp32 (tiled_linear.c); nonzero when out of memory. */
int tiled_linear(float *out, const float *x, int64_t rows, int64_t x_stride, int fmt, const float *scale,
                 const float *min, const void *q, const float *bias, int64_t K, int64_t N);

/* The same with int8 activations for a block-format W (int8_linear.c). */
int int8_linear(float *out, const float *x, int64_t rows, int64_t x_stride, int fmt, const float *scale,
                const float *min, const void *q, const float *bias, int64_t K, int64_t N, int per_row);

#endif
