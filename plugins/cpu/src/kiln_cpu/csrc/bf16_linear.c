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
