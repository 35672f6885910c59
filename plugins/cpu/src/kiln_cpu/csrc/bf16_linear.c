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
#define _DEFAULT_SOURCE /* syscall(), for AMX's permission (amx.h) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16_dots.h"
#include "vec.h"

/* *last: the rows of w's last block of BLOCK when N leaves it partial, zero-padded (NULL when
 * N is a multiple of BLOCK). Returns 1 when out of memory. */
static int last_block(uint16_t **last, const uint16_t *w, int64_t N, int64_t K) {
    const int64_t full = N / BLOCK;
    *last = NULL;
    if (N == full * BLOCK) return 0;
    if ((*last = calloc(BLOCK * K, sizeof(uint16_t))) == NULL) return 1;
    memcpy(*last, w + full * BLOCK * K, (N - full * BLOCK) * K * sizeof(uint16_t));
    return 0;
}

#if defined(__AMX_BF16__) && defined(__AVX512BW__)
/* AMX: out^T = w x^T, a tile at a time. The weight's 16 rows of a tile, 32 inputs at a time, are
 * an A tile as they lie (row stride K), so the layer keeps its one plain weight; the rows of x go
 * into B tiles, their inputs in pairs (a 32-bit word of two bf16 per row of 16 tokens), a copy
 * of x that is small beside the weight. tdpbf16ps sums each pair's products in fp32 into the C
 * tile; two C tiles take alternate 32-input steps, so that a product need not wait for the one
 * before, and are added once. A token's outputs do not depend on the other rows, so a row gives
 * the same outputs alone and in any batch. Decode-sized products stream the weight at near the
 * memory's rate for any number of rows: 30 layers of the default model's four bf16 projections
 * (212 MB) on a 2-core AMX Xeon took 12.3-14.0 ms at 1-16 rows, where the vdpbf16ps path below
 * took 10.2-10.6 at one row, 20.8 at 8 and 37.4 at 16, and oneDNN's prepacked GEMM 28-29 at each
 * (alternated, one hour). Prefill-sized products were faster in oneDNN (1.3-1.6x at 512 rows). */
#define AMX_BF16 1
#define AMX_TOKENS 16 /* a B tile's columns: tokens */

/* x (T, K) as B tiles: token group g's pair p of inputs at xt[(g * K / 2 + p) * 16 + j] for
 * token 16 g + j, zero past T. */
static void pairs_of_tokens(uint32_t *xt, const uint16_t *x, int64_t T, int64_t K) {
    const int64_t pairs = K / 2;
    for (int64_t t = 0; t < T; t++) {
        const uint32_t *row = (const uint32_t *)(x + t * K);
        uint32_t *col = xt + (t / AMX_TOKENS) * pairs * AMX_TOKENS + t % AMX_TOKENS;
        for (int64_t p = 0; p < pairs; p++) col[p * AMX_TOKENS] = row[p];
    }
}

static int amx_linear_bf16(uint16_t *out, const uint16_t *x, int64_t T, int64_t K, const uint16_t *w,
                           const float *bias, int64_t N) {
    const int64_t full = N / BLOCK, blocks = (N + BLOCK - 1) / BLOCK, groups = (T + AMX_TOKENS - 1) / AMX_TOKENS;
    const int64_t pairs = K / 2, steps = K / 32;
    uint16_t *last;
    if (last_block(&last, w, N, K)) return 1;
    uint32_t *xt = calloc(groups * pairs * AMX_TOKENS, sizeof(uint32_t));
    if (xt == NULL) {
        free(last);
        return 1;
    }
    pairs_of_tokens(xt, x, T, K);
    _Pragma("omp parallel if (T * K * N >= 65536)") {
        static const uint8_t rows[6] = {16, 16, 16, 16, 16, 16};
        static const uint16_t colsb[6] = {64, 64, 64, 64, 64, 64};
        amx_configure(6, rows, colsb); /* 0, 3: sums (16 features x 16 tokens); 1, 4: w; 2, 5: x */
        float c[2][BLOCK][AMX_TOKENS] __attribute__((aligned(64)));
        _Pragma("omp for schedule(static)") for (int64_t b = 0; b < blocks; b++) {
            const uint16_t *wb = b < full ? w + b * BLOCK * K : last;
            const int64_t width = b < full ? BLOCK : N - full * BLOCK;
            for (int64_t g = 0; g < groups; g++) {
                const uint32_t *xg = xt + g * pairs * AMX_TOKENS;
                _tile_zero(0);
                _tile_zero(3);
                for (int64_t s = 0; s < steps; s += 2) {
                    /* the next block's rows (contiguous) into L2 as fast as this one's are read: the
                     * tile loads' 16 rows a K apart had streamed at half the memory's rate (1 row of
                     * the default model's 30 layers: 20.9 ms against 13.7-15.1 with this; into L1,
                     * or two blocks ahead, 14.7-16.8) */
                    if (g == 0 && b + 1 < full)
                        for (int64_t line = 0; line < 32; line++)
                            __builtin_prefetch(w + (b + 1) * BLOCK * K + s * 16 * 32 + line * 32, 0, 2);
                    _tile_loadd(1, wb + s * 32, K * 2);
                    _tile_loadd(2, xg + s * 16 * AMX_TOKENS, AMX_TOKENS * 4);
                    _tile_dpbf16ps(0, 1, 2);
                    if (s + 1 < steps) {
                        _tile_loadd(4, wb + (s + 1) * 32, K * 2);
                        _tile_loadd(5, xg + (s + 1) * 16 * AMX_TOKENS, AMX_TOKENS * 4);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                }
                _tile_stored(0, c[0], AMX_TOKENS * 4);
                _tile_stored(3, c[1], AMX_TOKENS * 4);
                for (int64_t j = 0; j < AMX_TOKENS && g * AMX_TOKENS + j < T; j++)
                    for (int64_t f = 0; f < width; f++)
                        out[(g * AMX_TOKENS + j) * N + b * BLOCK + f] =
                            to_bf16(c[0][f][j] + c[1][f][j] + (bias ? bias[b * BLOCK + f] : 0.0f));
            }
        }
        _tile_release();
    }
    free(xt), free(last);
    return 0;
}
#endif

/* Whether linear_bf16 multiplies on AMX tiles (for N >= 16, K a multiple of 32). */
int linear_bf16_amx(void) {
#if defined(AMX_BF16)
    return amx_permitted();
#else
    return 0;
#endif
}

/* bias: N floats added before the rounding, or NULL. Returns 1 when out of memory. */
int linear_bf16(uint16_t *out, const uint16_t *x, int64_t T, int64_t K, const uint16_t *w, const float *bias,
                int64_t N) {
#if defined(AMX_BF16)
    if (N >= BLOCK && K % 32 == 0 && amx_permitted()) return amx_linear_bf16(out, x, T, K, w, bias, N);
#endif
    const int64_t full = N / BLOCK, blocks = (N + BLOCK - 1) / BLOCK;
    uint16_t *last;
    if (last_block(&last, w, N, K)) return 1;
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

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <time.h>

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* Seconds for n rounds of twelve independent chains of OP (enough to hide either instruction's
 * latency), each from its own start (equal ones would be one chain to the compiler); the empty asm
 * keeps each round's operands live, so no round folds away. */
#define TIMED_CHAINS(OP, a, b)                                                                              \
    do {                                                                                                    \
        __m512 c0 = _mm512_set1_ps(0), c1 = _mm512_set1_ps(1), c2 = _mm512_set1_ps(2),                      \
               c3 = _mm512_set1_ps(3), c4 = _mm512_set1_ps(4), c5 = _mm512_set1_ps(5),                      \
               c6 = _mm512_set1_ps(6), c7 = _mm512_set1_ps(7), c8 = _mm512_set1_ps(8),                      \
               c9 = _mm512_set1_ps(9), c10 = _mm512_set1_ps(10), c11 = _mm512_set1_ps(11);                  \
        const double t0 = seconds();                                                                        \
        for (int i = 0; i < n; i++) {                                                                       \
            c0 = OP(c0, a, b), c1 = OP(c1, a, b), c2 = OP(c2, a, b), c3 = OP(c3, a, b);                     \
            c4 = OP(c4, a, b), c5 = OP(c5, a, b), c6 = OP(c6, a, b), c7 = OP(c7, a, b);                     \
            c8 = OP(c8, a, b), c9 = OP(c9, a, b), c10 = OP(c10, a, b), c11 = OP(c11, a, b);                 \
            __asm__ volatile("" : "+v"(a), "+v"(b));                                                        \
        }                                                                                                   \
        elapsed = seconds() - t0;                                                                           \
        __asm__ volatile("" ::"v"(c0), "v"(c1), "v"(c2), "v"(c3), "v"(c4), "v"(c5), "v"(c6), "v"(c7),     \
                         "v"(c8), "v"(c9), "v"(c10), "v"(c11));                                             \
    } while (0)

static inline __m512 fma_op(__m512 c, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, c); }
static inline __m512 dot_op(__m512 c, __m512bh a, __m512bh b) { return _mm512_dpbf16_ps(c, a, b); }
#endif

/* Multiply-adds a second of vdpbf16ps (32 bf16 pairs an instruction) over those of fp32 FMAs (16),
 * each the best of five short timed loops on the calling thread, alternated: 2 on AMD Zen 4 and 5,
 * where both instructions issue at one rate; 0.5 on a 2-core Xeon whose AMX the VM hides (1.8
 * vdpbf16ps a ns against 6.9 FMAs). The two differ by 4x, so a busy machine does not turn the
 * answer around. 0 without AVX512-BF16. */
double bf16_dot_speed(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const int n = 4096;
    double fma_best = 1e30, dot_best = 1e30, elapsed;
    __m512 fa = _mm512_set1_ps(1.0f), fb = _mm512_set1_ps(0.5f);
    __m512bh da = (__m512bh)_mm512_set1_epi16(0x3f80), db = da;
    for (int round = 0; round < 5; round++) {
        TIMED_CHAINS(fma_op, fa, fb);
        fma_best = elapsed < fma_best ? elapsed : fma_best;
        TIMED_CHAINS(dot_op, da, db);
        dot_best = elapsed < dot_best ? elapsed : dot_best;
    }
    return (32.0 / dot_best) / (16.0 / fma_best);
#else
    return 0.0;
#endif
}

/* Whether the products run on vdpbf16ps: only then is this kernel measured faster than oneDNN. */
int linear_bf16_native(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}
