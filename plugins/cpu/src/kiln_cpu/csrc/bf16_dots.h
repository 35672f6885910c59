/*
 * bf16 dot products of a few activation rows with a block of weight rows, both bf16 as
 * stored, summed in fp32: the inner loops of the bf16 experts (experts.c) and of the small
 * bf16 linear layers (bf16_linear.c). Each output is a dot product of a row of x with a weight
 * row, over blocks of up to ROWS rows x BLOCK weight rows, so that a loaded vector serves
 * several products. With AVX512-BF16 a vdpbf16ps multiplies 32 bf16 pairs at once; otherwise
 * a word of two bf16 is split into its even (shifted) and odd (masked) halves as fp32.
 * K (the length of each product) must be a multiple of 2 * VL.
 */
#ifndef KILN_BF16_DOTS_H
#define KILN_BF16_DOTS_H

#include <stdint.h>
#include <string.h>

#include "vec.h"

#define ROWS 4
#define BLOCK 16 /* features per work item */

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
static inline vf dot_step(vf acc, const uint16_t *x, const uint16_t *w) {
    return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_loadu_si512(x), (__m512bh)_mm512_loadu_si512(w));
}
#else
typedef uint32_t vu __attribute__((vector_size(4 * VL)));
static inline vf dot_step(vf acc, const uint16_t *x, const uint16_t *w) {
    vu xw, ww;
    memcpy(&xw, x, sizeof xw);
    memcpy(&ww, w, sizeof ww);
    const vu even_x = xw << 16, odd_x = xw & 0xffff0000u, even_w = ww << 16, odd_w = ww & 0xffff0000u;
    return acc + (vf)even_x * (vf)even_w + (vf)odd_x * (vf)odd_w;
}
#endif

/* Lanes j < VL/2 of the result: pair sums of a's lanes; the rest: b's. */
static inline vf hadd(vf a, vf b) {
#if VL == 16
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

/* Lane i of the result: the sum of v[i]'s lanes, for VL vectors (v is overwritten). A tree of
 * pairwise sums: VL - 1 shuffle-and-add steps where one sum each would take VL steps. */
static inline vf sum_each(vf *v) {
    for (int n = VL; n > 1; n /= 2)
        for (int i = 0; i < n / 2; i++) v[i] = hadd(v[2 * i], v[2 * i + 1]);
    return v[0];
}

/* dots_RxF: out[r * F + f] = rows[r] . w[f * K ...] over K, for R rows and F weight rows (R * F
 * = 16 accumulators: enough to hide vdpbf16ps's latency, few enough for AVX2's registers).
 * Each step also prefetches the matching lines of the weight rows a BLOCK further on (the next
 * work item's, mostly): without it the loads and the products took turns rather than overlap,
 * and a layer of the benchmark's MoE (8 experts, 16 tokens, weights from memory) took 0.72 ms
 * with AVX512-BF16, 0.59 with it; 1.2 and 0.74 with AVX2 alone. */
#define DEFINE_DOTS(R, F)                                                                             \
    static void dots_##R##x##F(float *out, const uint16_t *const *rows, const uint16_t *w, int64_t K) { \
        vf acc[R * F];                                                                                \
        for (int i = 0; i < R * F; i++) acc[i] = splatf(0.0f);                                        \
        for (int64_t c = 0; c < K; c += 2 * VL) {                                                     \
            for (int r = 0; r < R; r++)                                                               \
                for (int f = 0; f < F; f++) acc[r * F + f] = dot_step(acc[r * F + f], rows[r] + c, w + f * K + c); \
            for (int f = 0; f < F; f++) __builtin_prefetch(w + (BLOCK + f) * K + c);                  \
        }                                                                                             \
        for (int i = 0; i < R * F; i += VL) {                                                         \
            const vf sums = sum_each(acc + i);                                                        \
            memcpy(out + i, &sums, sizeof sums);                                                      \
        }                                                                                             \
    }
DEFINE_DOTS(1, 16)
DEFINE_DOTS(2, 8)
DEFINE_DOTS(4, 4)

/* d[r * BLOCK + j] = rows[r] . w[j] (fp32, or rounded to bf16 if `rounded`) for n <= ROWS rows and
 * BLOCK weight rows: one row, two, or four at a time (three: the last repeated, its sums not stored). */
#define BLOCK_SUMS(R, F)                                                          \
    for (int f = 0; f < BLOCK; f += F) {                                          \
        float part[R * F];                                                        \
        dots_##R##x##F(part, rr, w + f * K, K);                                   \
        for (int64_t r = 0; r < n; r++)                                           \
            for (int j = 0; j < F; j++)                                           \
                d[r * BLOCK + f + j] = rounded ? round_bf16(part[r * F + j]) : part[r * F + j]; \
    }
static inline void block_sums(float *d, const uint16_t *const *rows, int64_t n, const uint16_t *w, int64_t K,
                              int rounded) {
    const uint16_t *rr[ROWS];
    for (int r = 0; r < ROWS; r++) rr[r] = rows[r < n ? r : n - 1];
    if (n == 1) BLOCK_SUMS(1, 16)
    else if (n == 2) BLOCK_SUMS(2, 8)
    else BLOCK_SUMS(4, 4)
}

#endif
