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
/* AMX: out^T = w x^T, a block of 16 weight rows and a group of 16 tokens at a time
 * (amx_bf16_sums), on the layer's one plain weight; the rows of x go into B tiles, their inputs
 * in pairs, a copy of x that is small beside the weight. A token's outputs do not depend on the
 * other rows, so a row gives the same outputs alone and in any batch. Decode-sized products
 * stream the weight at near the memory's rate for any number of rows: 30 layers of the default
 * model's four bf16 projections (212 MB) on a 2-core AMX Xeon took 12.3-14.0 ms at 1-16 rows,
 * where the vdpbf16ps path below took 10.2-10.6 at one row, 20.8 at 8 and 37.4 at 16, and
 * oneDNN's prepacked GEMM 28-29 at each (alternated, one hour). Prefill-sized products were
 * faster in oneDNN (1.3-1.6x at 512 rows). */
#define AMX_BF16 1

static int amx_linear_bf16(uint16_t *out, const uint16_t *x, int64_t T, int64_t K, const uint16_t *w,
                           const float *bias, int64_t N) {
    const int64_t full = N / BLOCK, blocks = (N + BLOCK - 1) / BLOCK, groups = (T + AMX_TOKENS - 1) / AMX_TOKENS;
    uint16_t *last;
    if (last_block(&last, w, N, K)) return 1;
    uint32_t *xt = calloc(groups * K / 2 * AMX_TOKENS, sizeof(uint32_t));
    if (xt == NULL) {
        free(last);
        return 1;
    }
    amx_pairs_of_rows(xt, x, NULL, T, K);
    _Pragma("omp parallel if (T * K * N >= 65536)") {
        amx_bf16_configure();
        float c[BLOCK][AMX_TOKENS] __attribute__((aligned(64)));
        _Pragma("omp for schedule(static)") for (int64_t b = 0; b < blocks; b++) {
            const uint16_t *wb = b < full ? w + b * BLOCK * K : last;
            const int64_t width = b < full ? BLOCK : N - full * BLOCK;
            const uint16_t *next = b + 1 < full ? w + (b + 1) * BLOCK * K : NULL;
            for (int64_t g = 0; g < groups; g++) {
                amx_bf16_sums(c, wb, K, xt + g * K / 2 * AMX_TOKENS, g == 0 ? next : NULL);
                for (int64_t j = 0; j < AMX_TOKENS && g * AMX_TOKENS + j < T; j++)
                    for (int64_t f = 0; f < width; f++) {
                        const float sum = c[f][j] + (bias ? bias[b * BLOCK + f] : 0.0f);
                        out[(g * AMX_TOKENS + j) * N + b * BLOCK + f] = to_bf16(sum);
                    }
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

/* The same product on w laid out in pair tiles, for weights past what the kernel above streams
 * well (an LM head). wp is (N/16, K/2, 16) words, word [t, c, j] holding w[16t + j, 2c] (low half)
 * and w[16t + j, 2c + 1]: one 64-byte line is 16 features' values at two inputs, so a row's two
 * inputs (one 32-bit broadcast) times it is one vdpbf16ps into that row's 16 sums, the
 * outer-product scheme of tiled_linear.c with no cross-lane sums, and a tile streams in order, a
 * line a step. Each output (plus bias) is summed in fp32 over the inputs in pairs, in order, and
 * rounded to bf16 once. Needs N % 16 == 0. */
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
static inline v16f pair_step(v16f acc, v16u w, uint32_t x) {
    return (v16f)_mm512_dpbf16_ps((__m512)acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32((int)x));
}
#else
/* vdpbf16ps's sums without it: the odd pair's product, then the even's (exact products in fp32). */
static inline v16f pair_step(v16f acc, v16u w, uint32_t x) {
    acc += (v16f)(w & 0xffff0000u) * from_bf16((uint16_t)(x >> 16));
    return acc + (v16f)(w << 16) * from_bf16((uint16_t)x);
}
#endif

/* How far ahead of a tile's line its stream asks for the next: 8 KB beat 4 KB and none by 10-30 %
 * at 8-16 rows of a 49152x512 head from memory (2-core Zen 5 EPYC). */
#define PAIR_AHEAD 8192

/* Rows r..r+R of x (K2 = K / 2 words a row) times tiles t..t+T, into out (bf16, row stride N); R and
 * T literal, R * T <= 16 sums. */
static inline __attribute__((always_inline)) void pair_rows(uint16_t *out, const uint32_t *x, int64_t r,
                                                            const uint32_t *wp, int64_t t, const float *bias,
                                                            int64_t K2, int64_t N, const int R, const int T) {
    v16f acc[16];
    for (int i = 0; i < R * T; i++) acc[i] = (v16f){0};
    const uint32_t *tile = wp + t * K2 * 16;
    for (int64_t c = 0; c < K2; c++) {
        v16u w[2];
        for (int s = 0; s < T; s++) {
            memcpy(&w[s], tile + (s * K2 + c) * 16, sizeof w[s]);
            __builtin_prefetch((const char *)(tile + (s * K2 + c) * 16) + PAIR_AHEAD, 0, 3);
        }
        for (int i = 0; i < R; i++) {
            const uint32_t xi = x[(r + i) * K2 + c];
            for (int s = 0; s < T; s++) acc[i * T + s] = pair_step(acc[i * T + s], w[s], xi);
        }
    }
    for (int s = 0; s < T; s++) {
        v16f b = {0};
        if (bias) memcpy(&b, bias + (t + s) * 16, sizeof b);
        for (int i = 0; i < R; i++) {
            const v16f sum = acc[i * T + s] + b;
            v8 half[2];
            memcpy(half, &sum, sizeof sum);
            for (int k = 0; k < 2; k++) store8_bf16(out + (r + i) * N + (t + s) * 16 + 8 * k, half[k]);
        }
    }
}

#define PAIR_CASE(R, T)                                 \
    case R:                                             \
        pair_rows(out, x, r, wp, t, bias, K2, N, R, T); \
        break;
/* One pass of n rows (up to 16 / T) over T tiles (1 or 2), each R its own copy. */
static void pair_pass(uint16_t *out, const uint32_t *x, int64_t r, int64_t n, const uint32_t *wp, int64_t t,
                      const float *bias, int64_t K2, int64_t N, int T) {
    if (T == 2) switch (n) {
        PAIR_CASE(1, 2) PAIR_CASE(2, 2) PAIR_CASE(3, 2) PAIR_CASE(4, 2)
        PAIR_CASE(5, 2) PAIR_CASE(6, 2) PAIR_CASE(7, 2) PAIR_CASE(8, 2)
    }
    else switch (n) {
        PAIR_CASE(1, 1) PAIR_CASE(2, 1) PAIR_CASE(3, 1) PAIR_CASE(4, 1)
        PAIR_CASE(5, 1) PAIR_CASE(6, 1) PAIR_CASE(7, 1) PAIR_CASE(8, 1)
        PAIR_CASE(9, 1) PAIR_CASE(10, 1) PAIR_CASE(11, 1) PAIR_CASE(12, 1)
        PAIR_CASE(13, 1) PAIR_CASE(14, 1) PAIR_CASE(15, 1) PAIR_CASE(16, 1)
    }
}

/* Up to 32 rows stream one tile at a time, in even passes of up to 16 rows (one stream a thread,
 * each line's load feeding every row of the pass: 16 rows of a 49152x512 head from memory took
 * 1.5-1.7 ms, against 2.1-2.2 over pairs of tiles in passes of 8 and 2.1 in oneDNN, on a 2-core
 * Zen 5 EPYC); more rows go over two tiles at a time in passes of up to 8, each broadcast feeding
 * two products, since there the products, not memory, set the pace (64 rows: 5.5 ms, against 5.9
 * a tile at a time and 4.7 in oneDNN). */
void linear_bf16_pairs(uint16_t *out, const uint16_t *x, int64_t T, int64_t K, const uint32_t *wp,
                       const float *bias, int64_t N) {
    const int64_t K2 = K / 2, tiles = N / 16;
    const int g = T <= 32 ? 1 : 2, most = 16 / g; /* tiles a group, rows a pass */
    const uint32_t *x2 = (const uint32_t *)x;
    _Pragma("omp parallel for schedule(static) if (T * K * N >= 65536)") for (int64_t p = 0; p < (tiles + g - 1) / g; p++) {
        const int count = p * g + g <= tiles ? g : 1; /* a last tile left over from the pairs goes alone */
        for (int64_t r = 0, passes = (T + most - 1) / most; r < T; passes--) {
            const int64_t size = (T - r + passes - 1) / passes;
            pair_pass(out, x2, r, size, wp, p * g, bias, K2, N, count);
            r += size;
        }
    }
}

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
