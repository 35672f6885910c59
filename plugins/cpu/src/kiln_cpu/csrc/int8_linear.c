/*
 * y = x W^T + b with integer dot products, for weights in Kiln's 4/8-bit tiles
 * (see kiln_cpu/tiled_weights.py): llama.cpp's scheme. Each row of x is quantized
 * per 32 inputs to int8 (scale dx = max|x| / 127, x ~ qx * dx), or with one scale for
 * the row (W8A8's per-token activations), and each 32-input block of the product is an
 * exact int32 sum, scaled once:
 *   fmt 8 (Q8_0, w = qw * dw):         dw dx sum(qw qx)
 *   fmt 4 (Q4_1, w = nibble * dw + m): dw dx sum(nibble qx) + m dx sum(qx)
 *   fmt 8 with a min (Q5_1, Q5_K: w = qw * dw + m): as fmt 4, qw 8-bit
 *   fmt 6 (Q6_K, a scale per 16 inputs): dw0 dx sum(qw qx) over the first 16 + dw1 dx (...),
 *         + m dx sum(qx) with a min (per 32 inputs: the one form for rows of mixed types)
 * Blocks are summed in order in fp32. Weight bytes of one tile and block lie as
 * (group of 4 inputs, 16 features, 4 inputs): a 32-bit lane holds 4 consecutive
 * inputs of one feature, which is what vpdpbusd / vpmaddubsw multiply and add.
 *   fmt 8 and 6: 8 groups (512 bytes), int8.
 *   fmt 4: 4 groups (256 bytes): the low nibbles are inputs 4g..4g+3, the high
 *          ones 16+4g..16+4g+3.
 * Quantized activations lie in panels of ROWS rows (the last one: the rows left, P): per
 * 32-input block, its 8 groups of 4 inputs, each group's 4 bytes for the panel's rows side by
 * side; the block's scales likewise, a float per row. A pass over a full panel then finds every
 * broadcast at a fixed offset from one pointer (with a pointer per row, the row loops spilled
 * and reloaded them from the stack), and a lone row's block is its 32 bytes in a row.
 * Instruction sets are chosen when the library is compiled (-march=native, on the
 * machine that runs it): AVX-VNNI or AVX-512 VNNI (vpdpbusd), AVX2 (vpmaddubsw),
 * else portable C. All give the same int32 block sums. With AMX-INT8, products of enough rows
 * multiply on the tiles (amx_linear), the same outputs bit for bit as the zmm path's.
 */
#define _DEFAULT_SOURCE /* syscall(), for AMX's permission (amx.h) */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define TILE 16
#define ROWS 8 /* rows of x per panel, and per pass over a tile's blocks */
#define ROW_CHUNK 64 /* rows whose quantized values stay in cache while every tile passes */
#define ROWS_PER_HANDOUT 8 /* rows from which tiles are handed out one at a time (int8_linear) */

#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* max |x[i]| over n values (n a multiple of 8 on AVX2). */
static float absmax(const float *x, int64_t n) {
    float amax = 0.0f;
#if defined(__AVX2__)
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(x + i)));
    /* across the lanes in registers: fmaxf on each (a libm call) cost ~1 % of a decode step */
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
    for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
#endif
    return amax;
}

/* A row of x as int8 per 32-block, into its lane of a panel: the block's group g of 4 values at
 * q + (8 b + g) P 4 (P: the panel's rows), its scale d[b D] and s[b D] = d * sum(q) (D: P, or
 * the rows of amx_linear's block-major scales). flip: each byte's top
 * bit flipped (qx + 128 as unsigned, see int8_linear).
 * per_row 0: a scale per block, qx = round(x * 127 / amax_block) (llama.cpp's).
 * per_row 1: one scale for the row, qx = round(x / (max(amax_row, 1e-10) / 127)): the integers
 * of per-token quantization in torch (kiln.interfaces.quantization.quantize_per_token), so W8A8's
 * blocks sum exactly what its reference sums. */
static void quantize_row(const float *x, int64_t K, int per_row, int flip, int P, int64_t D, int8_t *q, float *d,
                         float *s) {
    const float row_scale = per_row ? fmaxf(absmax(x, K), 1e-10f) / 127.0f : 0.0f;
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + b * 32;
        const float amax = per_row ? 0.0f : absmax(xb, 32);
        const float scale = per_row ? row_scale : amax / 127.0f;
        /* x * 127 / amax, or x / scale where the division's rounding must be torch's */
        const float mul = amax > 0.0f ? 127.0f / amax : 0.0f;
        const int divide = per_row;
        int sum = 0;
#if defined(__AVX2__)
        __m256i total = _mm256_setzero_si256();
        for (int i = 0; i < 32; i += 8) {
            const __m256 xv = _mm256_loadu_ps(xb + i);
            const __m256 scaled =
                divide ? _mm256_div_ps(xv, _mm256_set1_ps(scale)) : _mm256_mul_ps(xv, _mm256_set1_ps(mul));
            const __m256i v = _mm256_cvtps_epi32(scaled);
            total = _mm256_add_epi32(total, v);
            const __m128i v16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            const __m128i v8 = _mm_xor_si128(_mm_packs_epi16(v16, v16), _mm_set1_epi8(flip ? (char)0x80 : 0));
            const int32_t first = _mm_cvtsi128_si32(v8), second = _mm_extract_epi32(v8, 1);
            memcpy(q + (b * 8 + i / 4) * P * 4, &first, 4);
            memcpy(q + (b * 8 + i / 4 + 1) * P * 4, &second, 4);
        }
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, total);
        for (int i = 0; i < 8; i++) sum += lanes[i];
#else
        for (int i = 0; i < 32; i++) {
            const int v = (int)nearbyintf(divide ? xb[i] / scale : xb[i] * mul); /* ties to even, as vcvtps2dq */
            q[(b * 8 + i / 4) * P * 4 + i % 4] = (int8_t)(flip ? v ^ 0x80 : v);
            sum += v;
        }
#endif
        d[b * D] = scale, s[b * D] = scale * (float)sum;
    }
}

/* The rows of row r's panel, of `rows` in all. */
static inline int panel_rows(int64_t r, int64_t rows) {
    return rows - (r - r % ROWS) < ROWS ? (int)(rows - (r - r % ROWS)) : ROWS;
}

/* Where row r's lane of its panel starts: in the activations (K a row), in their scales. */
static inline int64_t lane_at(int64_t r, int64_t K) { return (r - r % ROWS) * K + r % ROWS * 4; }
static inline int64_t lane_scale_at(int64_t r, int64_t K) { return (r - r % ROWS) * (K / 32) + r % ROWS; }

/* Moves xq, xd and xs (the panels' starts) to row r's lane. */
static inline void row_lane(int64_t r, int64_t K, const int8_t **xq, const float **xd, const float **xs) {
    *xq += lane_at(r, K), *xd += lane_scale_at(r, K), *xs += lane_scale_at(r, K);
}

/* The 4 activations of group g, row i, of a block x of a panel of P rows. */
static inline const int8_t *group(const int8_t *x, int g, int i, int P) { return x + (g * P + i) * 4; }

#if defined(__AVX2__)

/* v, which the compiler must now hold: integer sums are associative, and GCC otherwise
 * regroups a block's products to add them last, computing (and spilling) all of them first. */
static inline __m256i in_register(__m256i v) {
    __asm__("" : "+x"(v));
    return v;
}

/* acc + the sums of four u8 x s8 products per 32-bit lane. */
static inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return in_register(_mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))));
#endif
}

static inline int32_t load4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline __m256i bcast4(const int8_t *p) { return _mm256_set1_epi32(load4(p)); }

/* Asks for the lines STREAM_AHEAD bytes past a block of `bytes` weight bytes (tiles follow each other
 * in memory, so near a tile's end the next one's), in a tile's first pass. Each tile's passes (of
 * up to 64 rows) had asked for the whole next tile first, a burst that waited on the fill buffers:
 * a Q4_1 1024x2048 product from memory took 93-139 us at 4 rows, 77-86 with this; 195-280 against
 * 174-178 at 16, Q8_0 303-383 against 260-345; level at 64 (2-core Xeon, alternated). */
static inline void stream_ahead(const uint8_t *w, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(w + STREAM_AHEAD + i);
}

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define HAS_VNNI 1
#else
#define HAS_VNNI 0
#endif

/* acc + a nibble vector times qx's low inputs plus another times its high ones. Without
 * VNNI, in vpmaddubsw's int16 pairs: a nibble times |qx| <= 127, twice, is at most 3810,
 * so all eight of a block add up in int16 (<= 30480) before one widening vpmaddwd. */
static inline __m256i q4_step(__m256i acc, __m256i lo, __m256i xl, __m256i hi, __m256i xh) {
#if HAS_VNNI
    return dot4(dot4(acc, lo, xl), hi, xh);
#else
    acc = _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
    return in_register(acc);
#endif
}

/* acc[r] = int32 sums of a block (x: its panel) for rows 0..R-1, features 8h..8h+7 (one half
 * of the tile at a time: R sums, two weight vectors and the broadcasts fit AVX2's 16 registers). */
static inline __attribute__((always_inline)) void block_q4(__m256i acc[], const uint8_t *w, int h, const int8_t *x,
                                                           int R, int P, const uint8_t *nib) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_si256();
    for (int g = 0; g < 4; g++) {
        __m256i lo, hi;
        if (nib) {
            lo = _mm256_load_si256((const __m256i *)(nib + g * 128 + h * 32));
            hi = _mm256_load_si256((const __m256i *)(nib + g * 128 + 64 + h * 32));
        } else {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + g * 64 + h * 32));
            lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        for (int r = 0; r < R; r++) acc[r] = q4_step(acc[r], lo, bcast4(group(x, g, r, P)), hi, bcast4(group(x, 4 + g, r, P)));
    }
#if !HAS_VNNI
    for (int r = 0; r < R; r++) acc[r] = _mm256_madd_epi16(acc[r], _mm256_set1_epi16(1));
#endif
}

/* acc[r] = int32 sums of groups g0..g0+ng-1 of a Q8 block, features 8h..8h+7 (fmt 6: a
 * scale's inputs are 4 groups). */
static inline __attribute__((always_inline)) void block_q8(__m256i acc[], const int8_t *w, int h, const int8_t *x,
                                                           int R, int P, int g0, int ng) {
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_si256();
    for (int g = g0; g < g0 + ng; g++) {
        /* u8 x s8 instructions: |w| times qx carrying w's sign (|qx| <= 127, so no overflow) */
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + g * 64 + h * 32));
        const __m256i aw = _mm256_abs_epi8(wv);
        for (int r = 0; r < R; r++) acc[r] = dot4(acc[r], aw, _mm256_sign_epi8(bcast4(group(x, g, r, P)), wv));
    }
}

/* A Q4 tile that four or more passes read has its nibbles split into bytes once, per block and
 * group its low nibbles (64 bytes: the 16 features' 4 inputs) then its high ones, and each pass
 * loads them (the split was 12 instructions of each block that the pass's 8 rows share). Those
 * passes are compiled apart (split_passes): with a test of the pointer in the products' loop the
 * split saved nothing. The default model's Q4_1 products on a 2-core Xeon (bench/kernel_ab.py, 12
 * rounds), 32-256 rows: AVX-512 VNNI 1-12 % faster, the AVX2 build 4-12 %; with AVX-512 fewer
 * rows keep the passes that split as they go, where the stores and reloads cost what they saved.
 * On ymm registers the split passes go a quarter at a time (quarter_times_split), and there the
 * default model's products at 16 and 24 rows split took 0.81-0.87x the time of unsplit passes in
 * the AVX2 build (Zen 5; 7B-wide ones 0.81-1.05x), so they split from 16 rows (at 8 rows: 0.9x
 * the default model's, but 1.04-1.16x for 7B-wide weights). The split is
 * SPLIT_BLOCKS blocks at a time (K up to 2048: 32 KB on the stack, in L1): a wider tile's passes
 * go over one part before the next is split, their sums left in out between parts. Split whole
 * into a heap buffer, such tiles had measured no faster (bench/kernel_ab.py's wide weights, K 4096
 * and 14336: B/A 1.08-1.11 at 32 rows); in parts, 0.85-0.96 at 32-256 rows in the AVX2 build, and
 * with AVX-512 VNNI 0.90-1.00 at 64-256 and level at 32. */
#define UNPACK_MIN_ROWS (AVX512_VNNI ? 4 * ROWS : 2 * ROWS) /* AVX512_VNNI: defined below */
#define SPLIT_BLOCKS 64
static void unpack_q4(uint8_t *nibbles, const uint8_t *w, int64_t nb) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t b = 0; b < nb; b++) {
        stream_ahead(w + b * 256, 256);
        for (int g = 0; g < 4; g++)
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + b * 256 + g * 64 + h * 32));
                uint8_t *o = nibbles + b * 512 + g * 128 + h * 32;
                _mm256_store_si256((__m256i *)o, _mm256_and_si256(v, low));
                _mm256_store_si256((__m256i *)(o + 64), _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
            }
    }
}

/* f + one row's int32 block sums acc (8 features), scaled: dw the weight scales, d the row's
 * activation scale; with a min (has_min), + m *s (s: the row's scale times its sum of qx). The one
 * epilogue of the ymm passes (rows_times_tile's and quarter_times_split's), so that they give
 * the same outputs bit for bit. */
static inline __attribute__((always_inline)) __m256 scale_sum(__m256 f, __m256i acc, __m256 dw, float d,
                                                              int has_min, __m256 m, const float *s) {
    f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(dw, _mm256_set1_ps(d)), f);
    if (has_min) f = _mm256_fmadd_ps(m, _mm256_set1_ps(*s), f);
    return f;
}

/* out[rows r..r+R) x features 16t..16t+15, over blocks b0..b1 (every block but in split_passes,
 * which passes over a wide tile a part at a time: `resume` takes up the sums left in out, and
 * they are left there without the bias until the last block); `stream`: the first pass over the
 * tile, which asks for the weights ahead (see stream_ahead); nib: blocks b0.. split (unpack_q4). */
static inline __attribute__((always_inline)) void rows_times_tile(float *out, int64_t N, const int8_t *xq,
                                                                  const float *xd, const float *xs, int64_t r,
                                                                  int R, int P, int fmt, const float *scale,
                                                                  const float *min, const void *q, int64_t t,
                                                                  int64_t K, const float *bias, int stream,
                                                                  int64_t b0, int64_t b1, int resume,
                                                                  const uint8_t *nib) {
    const int subs = scales_per_block(fmt), f16 = fmt & F16_SCALES;
    fmt = block_fmt(fmt);
    const int64_t nb = K / 32, bytes = fmt == 4 ? 256 : 512;
    row_lane(r, K, &xq, &xd, &xs);
    /* The fp32 sums stay in L1, read and written once a block: the 16 ymm registers hold the
     * block's integer sums, the weights and the broadcast activations (with the fp32 sums in
     * registers too the compiler spilled the integer ones inside the product loop). */
    float sums[ROWS][TILE] __attribute__((aligned(32)));
    for (int i = 0; i < R; i++) {
        if (resume) memcpy(sums[i], out + (r + i) * N + t * TILE, sizeof sums[i]);
        else memset(sums[i], 0, sizeof sums[i]);
    }
    for (int64_t b = b0; b < b1; b++) {
        const int8_t *x = xq + b * 32 * P;
        const uint8_t *w = (const uint8_t *)q + (t * nb + b) * bytes;
        if (stream) stream_ahead(w, bytes);
        for (int sub = 0; sub < subs; sub++) {
            const int64_t at = ((t * nb + b) * subs + sub) * TILE;
            for (int h = 0; h < 2; h++) {
                __m256i acc[ROWS];
                if (fmt == 4)
                    block_q4(acc, w, h, x, R, P, nib ? nib + (b - b0) * 512 : NULL);
                else if (fmt == 6)
                    block_q8(acc, (const int8_t *)w, h, x, R, P, 4 * sub, 4);
                else
                    block_q8(acc, (const int8_t *)w, h, x, R, P, 0, 8);
                const __m256 dw = (__m256)load8_scale(scale, at + 8 * h, f16);
                /* a min per 32 inputs, in every format */
                const int has_min = min && sub == 0;
                const __m256 m = has_min ? (__m256)load8_scale(min, (t * nb + b) * TILE + 8 * h, f16) : dw;
                for (int i = 0; i < R; i++)
                    _mm256_store_ps(sums[i] + 8 * h, scale_sum(_mm256_load_ps(sums[i] + 8 * h), acc[i], dw, xd[b * P + i],
                                                               has_min, m, xs + b * P + i));
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int h = 0; h < 2; h++) {
            const __m256 bv = bias && b1 == nb ? _mm256_loadu_ps(bias + t * TILE + 8 * h) : _mm256_setzero_ps();
            _mm256_storeu_ps(out + (r + i) * N + t * TILE + 8 * h, _mm256_add_ps(_mm256_load_ps(sums[i] + 8 * h), bv));
        }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* AVX-512 VNNI: a group of a tile's block (16 features x 4 inputs, 64 bytes) is one zmm, its
 * int32 lanes the 16 features, so one vpdpbusd per row and group (half the instructions of
 * the ymm path; on this project's EPYC, prefill-sized products ran ~3x as fast). vpdpbusd
 * multiplies u8 by s8 and AVX-512 has no vpsignb: Q4's nibbles are the u8 operand as they
 * are; for Q8 the activations go unsigned (qx + 128, see int8_linear) and 128 * sum(w) is
 * taken off each block. The int32 block sums are exact and the epilogue is the ymm path's,
 * lane for lane, so both give the same outputs bit for bit. */
#define AVX512_VNNI 1

/* Values i..i+15 of a scale or min array (see vec.h's load8_scale). */
static inline __m512 load16_scale(const float *p, int64_t i, int f16) {
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))) : _mm512_loadu_ps(p + i);
}

/* f[i] += the int32 block sums acc[i] of rows i < R, scaled: dw the weight scales, d[i] the rows'
 * activation scales; with a min m, + m s[i] (s: the rows' scales times their sums of qx). The
 * one epilogue of both zmm paths, vpdpbusd's and the AMX tiles', so that they give the same
 * outputs bit for bit. */
static inline __attribute__((always_inline)) void scale_sums(__m512 f[], const __m512i acc[], int R, __m512 dw,
                                                             const float *d, const float *s, const __m512 *m) {
    for (int i = 0; i < R; i++) {
        const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(d[i]));
        f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), dd, f[i]);
    }
    if (m)
        for (int i = 0; i < R; i++) f[i] = _mm512_fmadd_ps(*m, _mm512_set1_ps(s[i]), f[i]);
}

/* Q8's correction for unsigned activations, once a tile (not once a pass over it): per block and
 * scale, -128 * sum(w) of each of the 16 features, with which every row's integer sums start. */
static void unsigned_offsets(int32_t *offsets, const int8_t *w, int64_t nb, int subs) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < nb; b++)
        for (int sub = 0; sub < subs; sub++) {
            __m512i wsum = _mm512_setzero_si512();
            for (int g = sub * 8 / subs; g < (sub + 1) * 8 / subs; g++)
                wsum = _mm512_dpbusd_epi32(wsum, ones, _mm512_loadu_si512(w + b * 512 + g * 64));
            _mm512_storeu_si512(offsets + (b * subs + sub) * TILE, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(wsum, 7)));
        }
}

static inline __attribute__((always_inline)) void rows_times_tile_512(float *out, int64_t N, const int8_t *xq,
                                                                      const float *xd, const float *xs, int64_t r,
                                                                      int R, int P, int fmt, const float *scale,
                                                                      const float *min, const void *q, int64_t t,
                                                                      int64_t K, const float *bias, int stream,
                                                                      int64_t b0, int64_t b1, int resume,
                                                                      const int32_t *offsets, const uint8_t *nib) {
    const int subs = scales_per_block(fmt), groups = 8 / subs, f16 = fmt & F16_SCALES; /* groups: Q8's per scale */
    fmt = block_fmt(fmt);
    const int64_t nb = K / 32, bytes = fmt == 4 ? 256 : 512;
    const __m512i low = _mm512_set1_epi8(15);
    row_lane(r, K, &xq, &xd, &xs);
    __m512 f[ROWS];
    for (int i = 0; i < R; i++) f[i] = resume ? _mm512_loadu_ps(out + (r + i) * N + t * TILE) : _mm512_setzero_ps();
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *w = (const uint8_t *)q + (t * nb + b) * bytes;
        const int8_t *x = xq + b * 32 * P;
        if (stream) stream_ahead(w, bytes);
        for (int sub = 0; sub < subs; sub++) {
            __m512i acc[ROWS];
            if (fmt == 4) {
                for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_si512();
                for (int g = 0; g < 4; g++) {
                    __m512i lo, hi;
                    if (nib) {
                        lo = _mm512_load_si512(nib + (b - b0) * 512 + g * 128);
                        hi = _mm512_load_si512(nib + (b - b0) * 512 + g * 128 + 64);
                    } else {
                        const __m512i v = _mm512_loadu_si512(w + g * 64);
                        lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                    }
                    for (int i = 0; i < R; i++) {
                        acc[i] = _mm512_dpbusd_epi32(acc[i], lo, _mm512_set1_epi32(load4(group(x, g, i, P))));
                        acc[i] = _mm512_dpbusd_epi32(acc[i], hi, _mm512_set1_epi32(load4(group(x, 4 + g, i, P))));
                    }
                }
            } else {
                const __m512i offset = _mm512_loadu_si512(offsets + (b * subs + sub) * TILE);
                for (int i = 0; i < R; i++) acc[i] = offset;
                for (int g = sub * groups; g < (sub + 1) * groups; g++) {
                    const __m512i v = _mm512_loadu_si512(w + g * 64);
                    for (int i = 0; i < R; i++)
                        acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(load4(group(x, g, i, P))), v);
                }
            }
            const __m512 dw = load16_scale(scale, ((t * nb + b) * subs + sub) * TILE, f16);
            const int has_min = min && sub == 0; /* a min per 32 inputs, in every format */
            const __m512 m = has_min ? load16_scale(min, (t * nb + b) * TILE, f16) : dw;
            scale_sums(f, acc, R, dw, xd + b * P, xs + b * P, has_min ? &m : NULL);
        }
    }
    const __m512 bv = bias && b1 == nb ? _mm512_loadu_ps(bias + t * TILE) : _mm512_setzero_ps();
    for (int i = 0; i < R; i++) _mm512_storeu_ps(out + (r + i) * N + t * TILE, _mm512_add_ps(f[i], bv));
}
#define ROWS_TIMES_TILE(...) rows_times_tile_512(__VA_ARGS__, offsets, nib)
#else
#define AVX512_VNNI 0
#define ROWS_TIMES_TILE(...) rows_times_tile(__VA_ARGS__, nib)

/* Rows r..r+3 of a full panel times half h (features 8h..8h+7) of a Q4 tile split into bytes
 * (nib: its blocks b0..b1), the sums as rows_times_tile's: four rows' fp32 sums stay in
 * registers beside their integer sums, the weights and the broadcasts, where rows_times_tile's
 * passes of eight rows over both halves load and store theirs in L1 every block. The default
 * model's Q4_1 products at 32-512 rows (bench/kernel_ab.py on a 2-core Zen 5, the same outputs
 * bit for bit) took 0.86-0.96x the time in the AVX2 build and 0.67-0.79x with AVX-VNNI; passes
 * over unsplit tiles, or the Q8_0 LM head, so split into quarters were slower at 1-16 rows (up to
 * 1.4x) and gained under 15 % past that, so they stay as they were. */
static inline __attribute__((always_inline)) void quarter_times_split(float *out, int64_t N, const int8_t *xq,
                                                                      const float *xd, const float *xs, int64_t r,
                                                                      int h, int f16, const float *scale,
                                                                      const float *min, int64_t t, int64_t K,
                                                                      const float *bias, int64_t b0, int64_t b1,
                                                                      int resume, const uint8_t *nib) {
    const int64_t nb = K / 32;
    row_lane(r, K, &xq, &xd, &xs);
    float *o = out + r * N + t * TILE + 8 * h;
    __m256 f[4];
    for (int i = 0; i < 4; i++) f[i] = resume ? _mm256_loadu_ps(o + i * N) : _mm256_setzero_ps();
    for (int64_t b = b0; b < b1; b++) {
        __m256i acc[4];
        block_q4(acc, NULL, h, xq + b * 32 * ROWS, 4, ROWS, nib + (b - b0) * 512);
        const __m256 dw = (__m256)load8_scale(scale, (t * nb + b) * TILE + 8 * h, f16);
        const __m256 m = min ? (__m256)load8_scale(min, (t * nb + b) * TILE + 8 * h, f16) : dw;
        for (int i = 0; i < 4; i++) f[i] = scale_sum(f[i], acc[i], dw, xd[b * ROWS + i], min != NULL, m, xs + b * ROWS + i);
    }
    const __m256 bv = bias && b1 == nb ? _mm256_loadu_ps(bias + t * TILE + 8 * h) : _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + i * N, _mm256_add_ps(f[i], bv));
}
#endif

/* The full panels of rows r0..r1 over a Q4 tile split once (unpack_q4): the rows passed. Apart
 * from tile_rows, so that its passes over unsplit tiles compile as before (with the split ones
 * inlined beside them, products of 1-4 rows ran 3-26 % slower, the Q8_0 LM head most). */
static __attribute__((noinline)) int64_t split_passes(float *out, int64_t N, const int8_t *xq, const float *xd,
                                                      const float *xs, int64_t r0, int64_t r1, int fmt,
                                                      const float *scale, const float *min, const void *q, int64_t t,
                                                      int64_t K, const float *bias, const int32_t *offsets) {
    (void)offsets;
    const int64_t nb = K / 32, end = r0 + (r1 - r0) / ROWS * ROWS;
    uint8_t split[SPLIT_BLOCKS * 512] __attribute__((aligned(64)));
    const uint8_t *nib = split;
    fmt = 4 | (fmt & F16_SCALES); /* what the compiler can see: Q4's products only */
    for (int64_t b0 = 0; b0 < nb; b0 += SPLIT_BLOCKS) {
        const int64_t b1 = b0 + SPLIT_BLOCKS < nb ? b0 + SPLIT_BLOCKS : nb;
        unpack_q4(split, (const uint8_t *)q + (t * nb + b0) * 256, b1 - b0);
        for (int64_t r = r0; r < end; r += ROWS) {
#if AVX512_VNNI
            ROWS_TIMES_TILE(out, N, xq, xd, xs, r, ROWS, ROWS, fmt, scale, min, q, t, K, bias, 0, b0, b1, b0 > 0);
#else
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < ROWS; i += 4)
                    quarter_times_split(out, N, xq, xd, xs, r + i, h, fmt & F16_SCALES, scale, min, t, K, bias, b0,
                                        b1, b0 > 0, nib);
#endif
        }
    }
    return end;
}

static void tile_rows(float *out, int64_t N, const int8_t *xq, const float *xd, const float *xs, int64_t r0,
                      int64_t r1, int fmt, const float *scale, const float *min, const void *q, int64_t t, int64_t K,
                      const float *bias) {
    const int64_t nb = K / 32;
    const uint8_t *nib = NULL; /* the passes below split the nibbles themselves */
    (void)nib;
#if AVX512_VNNI
    /* Q8's offsets once for every pass over the tile: each pass computed them again, 8 of a block's
     * 104 vector instructions at 8 rows, and took 8 more to subtract them */
    const int64_t bytes = block_fmt(fmt) == 4 ? 256 : 512;
    int32_t offsets[block_fmt(fmt) == 4 ? 1 : nb * scales_per_block(fmt) * TILE];
    if (block_fmt(fmt) != 4) unsigned_offsets(offsets, (const int8_t *)q + t * nb * bytes, nb, scales_per_block(fmt));
#else
    const int32_t *offsets = NULL;
#endif
    /* Full panels, then the last one's rows in one pass (r1 ends every chunk but the last on a
     * panel). A literal R and P each: the compiler unrolls every row loop and folds each
     * broadcast's offset (with P a variable, a single row's products ran ~5 % slower). */
    int64_t r = r0;
    if (block_fmt(fmt) == 4 && r1 - r0 >= UNPACK_MIN_ROWS)
        r = split_passes(out, N, xq, xd, xs, r0, r1, fmt, scale, min, q, t, K, bias, offsets);
    for (; r + ROWS <= r1; r += ROWS)
        ROWS_TIMES_TILE(out, N, xq, xd, xs, r, ROWS, ROWS, fmt, scale, min, q, t, K, bias, r == r0, 0, nb, 0);
    switch (r1 - r) {
#define LAST_PANEL(P) \
    case P: ROWS_TIMES_TILE(out, N, xq, xd, xs, r, P, P, fmt, scale, min, q, t, K, bias, r == r0, 0, nb, 0); break;
        LAST_PANEL(1) LAST_PANEL(2) LAST_PANEL(3) LAST_PANEL(4) LAST_PANEL(5) LAST_PANEL(6) LAST_PANEL(7)
#undef LAST_PANEL
    }
}

#else /* portable C */

/* The int32 sum of block b of feature f times qx (32 values: x, a row's lane of the block in a
 * panel of P rows), over inputs i0..i0+n-1 (a multiple of 4; 4-bit blocks whole). */
static int32_t block_dot(int fmt, const void *q, int64_t t, int64_t nb, int64_t b, int f, const int8_t *x, int P,
                         int i0, int n) {
    int32_t sum = 0;
    if (fmt == 4) {
        const uint8_t *w = (const uint8_t *)q + (t * nb + b) * 256;
        for (int g = 0; g < 4; g++)
            for (int i = 0; i < 4; i++) {
                const uint8_t byte = w[(g * TILE + f) * 4 + i];
                sum += (byte & 15) * group(x, g, 0, P)[i] + (byte >> 4) * group(x, 4 + g, 0, P)[i];
            }
    } else {
        const int8_t *w = (const int8_t *)q + (t * nb + b) * 512;
        for (int g = i0 / 4; g < (i0 + n) / 4; g++)
            for (int i = 0; i < 4; i++) sum += w[(g * TILE + f) * 4 + i] * group(x, g, 0, P)[i];
    }
    return sum;
}

static void tile_rows(float *out, int64_t N, const int8_t *xq, const float *xd, const float *xs, int64_t r0,
                      int64_t r1, int fmt, const float *scale, const float *min, const void *q, int64_t t, int64_t K,
                      const float *bias) {
    const int64_t nb = K / 32;
    const int subs = scales_per_block(fmt), f16 = fmt & F16_SCALES;
    fmt = block_fmt(fmt);
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *x = xq;
        const float *d = xd, *s = xs;
        row_lane(r, K, &x, &d, &s);
        const int P = panel_rows(r, r1);
        for (int f = 0; f < TILE; f++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++)
                for (int sub = 0; sub < subs; sub++) {
                    const int64_t at = ((t * nb + b) * subs + sub) * TILE + f;
                    const int32_t dot = block_dot(fmt, q, t, nb, b, f, x + b * 32 * P, P, sub * 32 / subs, 32 / subs);
                    acc += (float)dot * (scale_at(scale, at, f16) * d[b * P]);
                    if (min && sub == 0) acc += scale_at(min, (t * nb + b) * TILE + f, f16) * s[b * P];
                }
            out[r * N + t * TILE + f] = acc + (bias ? bias[t * TILE + f] : 0.0f);
        }
    }
}

#endif

#if defined(__AMX_INT8__) && defined(AVX512_VNNI) && AVX512_VNNI
/* AMX (Xeon Sapphire Rapids and later): one tile product multiplies 16 rows of activations by a
 * block's inputs for the 16 features of a weight tile, where vpdpbusd takes one row at a time. A
 * block's bytes (8 groups of 16 features x 4 inputs) are as they lie a B tile of 8 rows; the
 * activations are quantized row by row (quantize_row with a panel of one row) so that 16 rows'
 * blocks are an A tile with a row's K bytes as its stride; Q4's nibbles are split into bytes once
 * a tile and chunk of rows (amx_unpack_q4). The int32 sums of a block (Q6: of each half) are
 * stored and scaled in fp32 by rows_times_tile_512's epilogue (scale_sums), so
 * both paths give the same outputs bit for bit and a row's outputs do not depend on how many rows
 * it came with. Activations stay signed: AMX multiplies s8 by s8 (Q8, Q6) and s8 by u8 (Q4's
 * nibbles). That epilogue, 3-4 vector instructions per 16 sums of a block, bounds the products:
 * tile instructions and vector ones did not overlap (microcoded tile loads and stores), and a
 * block's 32 inputs fill half of what one tile product can take. */
#define AMX_INT8 1
#include "amx.h"
#define AMX_ROW_CHUNK 256 /* rows whose activations stay in L2 while every tile passes */
#define AMX_ROWS 16       /* an A tile's rows */

/* Rows from which a product of format fmt goes to the tiles: where they outran vpdpbusd on a
 * 2-core AMX Xeon (bench/kernel_ab.py, the default model's weights): Q8_0 0.6-0.74x its time from
 * 16 rows; Q4_1 0.80-0.94x from 32, 1.0-1.15x at 16 (its nibbles split, and a min per block). */
static int amx_min_rows(int fmt) { return block_fmt(fmt) == 4 ? 32 : 16; }

/* Two sets of tiles, so that one block's product runs while the previous one's sums are scaled:
 * 0 and 3, the int32 sums (16 rows of 16); 1 and 4, 16 rows' kb activation bytes; 2 and 5, kb / 4
 * rows of a block's groups. */
static void amx_int8_tiles(int kb) {
    const uint8_t rows[6] = {AMX_ROWS, AMX_ROWS, kb / 4, AMX_ROWS, AMX_ROWS, kb / 4};
    const uint16_t colsb[6] = {TILE * 4, kb, TILE * 4, TILE * 4, kb, TILE * 4};
    amx_configure(6, rows, colsb);
}

/* A Q4 tile's nb blocks as bytes in input order: low nibbles of groups 0-3 (inputs 0-15), then
 * the high ones (16-31). */
static void amx_unpack_q4(uint8_t *bytes, const uint8_t *w, int64_t nb) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < nb; b++)
        for (int g = 0; g < 4; g++) {
            stream_ahead(w + b * 256 + g * 64, 64);
            const __m512i v = _mm512_loadu_si512(w + b * 256 + g * 64);
            _mm512_store_si512(bytes + b * 512 + g * 64, _mm512_and_si512(v, low));
            _mm512_store_si512(bytes + b * 512 + 256 + g * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
}

/* Tiles C = A B for step s (block s / subs, its part s % subs: kb inputs, kb * TILE weight
 * bytes) of rows r; tile numbers are the instructions' immediates. */
#define AMX_PRODUCT(C, A, B, s)                           \
    do {                                                  \
        _tile_zero(C);                                    \
        _tile_loadd(A, x + (s) * kb, K);                  \
        _tile_loadd(B, w + (s) * kb * TILE, TILE * 4);    \
        if (q4) _tile_dpbsud(C, A, B);                    \
        else _tile_dpbssd(C, A, B);                       \
    } while (0)

/* f[i] += step s's sums (as _tile_stored left them), scaled. */
static inline __attribute__((always_inline)) void amx_scale(__m512 f[], int32_t sums[][TILE], __m512 dw,
                                                            const float *d, const float *s, const __m512 *m) {
    __m512i acc[AMX_ROWS];
    for (int i = 0; i < AMX_ROWS; i++) acc[i] = _mm512_load_si512(sums[i]);
    scale_sums(f, acc, AMX_ROWS, dw, d, s, m);
}

/* out[rows r0..r1) x features 16t..16t+15. xq: rows quantized one after another, padded to
 * whole A tiles (R rows); xd, xs: their scales and sums, block by block (R a block); w: the
 * tile's blocks as bytes (Q4 split by amx_unpack_q4). Steps alternate between the two sets of
 * tiles: step s + 1 is multiplied while step s's sums are scaled. */
static void amx_tile_rows(float *out, int64_t N, const int8_t *xq, const float *xd, const float *xs, int64_t R,
                          int64_t r0, int64_t r1, int fmt, const float *scale, const float *min, const uint8_t *w,
                          int64_t t, int64_t K, const float *bias) {
    const int subs = scales_per_block(fmt), f16 = fmt & F16_SCALES, q4 = block_fmt(fmt) == 4, kb = 32 / subs;
    const int64_t nb = K / 32, steps = nb * subs, first = t * steps * TILE; /* the tile's first scale */
    int32_t sums[2][AMX_ROWS][TILE] __attribute__((aligned(64)));
    for (int64_t r = r0; r < r1; r += AMX_ROWS) {
        const int8_t *x = xq + r * K;
        __m512 f[AMX_ROWS];
        for (int i = 0; i < AMX_ROWS; i++) f[i] = _mm512_setzero_ps();
        AMX_PRODUCT(0, 1, 2, 0);
        for (int64_t s = 0; s < steps; s++) {
            const int64_t b = s / subs;
            if (r == r0 && !q4) stream_ahead(w + s * kb * TILE, kb * TILE);
            const __m512 dw = load16_scale(scale, first + s * TILE, f16);
            const __m512 m = min && s % subs == 0 ? load16_scale(min, (t * nb + b) * TILE, f16) : dw;
            const float *d = xd + b * R + r, *sx = xs + b * R + r;
            if (s % 2 == 0) {
                if (s + 1 < steps) AMX_PRODUCT(3, 4, 5, s + 1);
                _tile_stored(0, sums[0], TILE * 4);
                amx_scale(f, sums[0], dw, d, sx, min && s % subs == 0 ? &m : NULL);
            } else {
                if (s + 1 < steps) AMX_PRODUCT(0, 1, 2, s + 1);
                _tile_stored(3, sums[1], TILE * 4);
                amx_scale(f, sums[1], dw, d, sx, min && s % subs == 0 ? &m : NULL);
            }
        }
        const __m512 bv = bias ? _mm512_loadu_ps(bias + t * TILE) : _mm512_setzero_ps();
        for (int i = 0; i < AMX_ROWS && r + i < r1; i++) _mm512_storeu_ps(out + (r + i) * N + t * TILE, _mm512_add_ps(f[i], bv));
    }
}
#undef AMX_PRODUCT

/* int8_linear on AMX tiles (rows >= amx_min_rows(fmt), fmt 4, 6 or 8). Nonzero when out of memory. */
static int amx_linear(float *out, const float *x, int64_t rows, int64_t x_stride, int fmt, const float *scale,
                      const float *min, const void *q, const float *bias, int64_t K, int64_t N, int per_row) {
    const int64_t nb = K / 32, padded = (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    const int q4 = block_fmt(fmt) == 4;
    int8_t *xq = calloc(padded, K);
    float *xd = calloc(padded * nb, sizeof(float)), *xs = calloc(padded * nb, sizeof(float));
    /* each thread's split Q4 tile, allocated before the threads start: all of them must reach
     * the same loops */
    uint8_t *split = q4 ? aligned_alloc(64, omp_get_max_threads() * nb * 512) : NULL;
    const int failed = xq == NULL || xd == NULL || xs == NULL || (q4 && split == NULL);
    if (!failed) _Pragma("omp parallel") {
        _Pragma("omp for schedule(static)") for (int64_t r = 0; r < rows; r++)
            quantize_row(x + r * x_stride, K, per_row, 0, 1, padded, xq + r * K, xd + r, xs + r);
        uint8_t *bytes = q4 ? split + omp_get_thread_num() * nb * 512 : NULL;
        amx_int8_tiles(32 / scales_per_block(fmt));
        const int64_t tiles = N / TILE;
        for (int64_t r0 = 0; r0 < rows; r0 += AMX_ROW_CHUNK) {
            const int64_t r1 = r0 + AMX_ROW_CHUNK < rows ? r0 + AMX_ROW_CHUNK : rows;
            _Pragma("omp for schedule(dynamic, 1) nowait") for (int64_t t = 0; t < tiles; t++) {
                const uint8_t *w = (const uint8_t *)q + t * nb * (q4 ? 256 : 512);
                if (q4) amx_unpack_q4(bytes, w, nb), w = bytes;
                amx_tile_rows(out, N, xq, xd, xs, padded, r0, r1, fmt, scale, min, w, t, K, bias);
            }
        }
        _tile_release();
    }
    free(xq), free(xd), free(xs), free(split);
    return failed;
}
#endif

/* The rows from which int8_linear multiplies a format fmt on AMX tiles; 0 where it does not (a
 * build or CPU without AMX-INT8, or a kernel that refused the process its tiles). */
int int8_amx_rows(int fmt) {
#if defined(AMX_INT8)
    return amx_permitted() ? amx_min_rows(fmt) : 0;
#else
    (void)fmt;
    return 0;
#endif
}

int tiled_linear(float *, const float *, int64_t, int64_t, int, const float *, const float *, const void *,
                 const float *, int64_t, int64_t);

/* out = x W^T + bias with int8 activations for a block-format W (fmt 4, 6 or 8), quantized per
 * 32-input block, or per row with per_row (see quantize_row); fp32 tiles have no integers to
 * multiply and go to tiled_linear. Nonzero when out of memory. */
int int8_linear(float *out, const float *x, int64_t rows, int64_t x_stride, int fmt, const float *scale,
                const float *min, const void *q, const float *bias, int64_t K, int64_t N, int per_row) {
    const int base = block_fmt(fmt);
    if (base != 4 && base != 6 && base != 8) return tiled_linear(out, x, rows, x_stride, fmt, scale, min, q, bias, K, N);
#if defined(AMX_INT8)
    if (rows >= amx_min_rows(fmt) && amx_permitted())
        return amx_linear(out, x, rows, x_stride, fmt, scale, min, q, bias, K, N, per_row);
#endif
    const int64_t nb = K / 32;
    int8_t *xq = malloc(rows * K);
    float *xd = malloc(rows * nb * sizeof(float)), *xs = malloc(rows * nb * sizeof(float));
    if (xq == NULL || xd == NULL || xs == NULL) {
        free(xq), free(xd), free(xs);
        return 1;
    }
#if defined(AVX512_VNNI) && AVX512_VNNI
    const int flip = base != 4; /* Q8's activations as vpdpbusd's unsigned operand: qx + 128 */
#else
    const int flip = 0;
#endif
    _Pragma("omp parallel") {
        /* a panel a thread: rows of one panel share cache lines */
        _Pragma("omp for schedule(static)") for (int64_t p = 0; p < rows; p += ROWS) {
            const int P = panel_rows(p, rows);
            for (int64_t r = p; r < p + P; r++)
                quantize_row(x + r * x_stride, K, per_row, flip, P, P, xq + lane_at(r, K), xd + lane_scale_at(r, K),
                             xs + lane_scale_at(r, K));
        }
        /* From ROWS_PER_HANDOUT rows on, tiles go one at a time to whichever thread is free: the threads do
         * not run at one speed (the server's other threads, the machine's neighbours), and with
         * even shares the faster one waited at the end. On a 2-core AVX2-only EPYC, W4 of issue 17
         * (64 decodes per step) went from 207-214 to 222-232 output tok/s. Fewer rows keep one
         * even share per thread: a tile of one row is too little work per hand-out. */
        const int64_t tiles = N / TILE, threads = omp_get_num_threads();
        const int64_t share = rows >= ROWS_PER_HANDOUT ? 1 : (tiles + threads - 1) / threads;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_CHUNK) {
            const int64_t r1 = r0 + ROW_CHUNK < rows ? r0 + ROW_CHUNK : rows;
            _Pragma("omp for schedule(dynamic, share) nowait") for (int64_t t = 0; t < tiles; t++)
                tile_rows(out, N, xq, xd, xs, r0, r1, fmt, scale, min, q, t, K, bias);
        }
    }
    free(xq), free(xd), free(xs);
    return 0;
}
