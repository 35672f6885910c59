/*
 * Fused element-wise ops for Kiln's CPU plugin: RMSNorm, add + RMSNorm, rotary
 * embedding (NeoX rotate-half), SiLU-and-mul and GeGLU (tanh GELU). Each replaces 3 to 20 small
 * torch ops per layer, whose dispatch costs more than the arithmetic at decode
 * batch sizes.
 *
 * Arithmetic is fp32. The bf16 variants round wherever the torch reference
 * (kiln.interfaces.model) rounds, so they agree with it to the last bit except for the order
 * of the sum of squares and exp's last ulp:
 *   rms_norm:     out = w * bf16(x * rsqrt(mean(x^2) + eps))
 *   add_rms_norm: r = bf16(x + r); x = w * bf16(r * rsqrt(mean(r^2) + eps))
 *   silu_and_mul: out = bf16(silu(gate)) * up
 *   gelu_tanh_and_mul: out = bf16(gelu_tanh(gate)) * up (Gemma's GeGLU)
 * Work is split over rows with OpenMP only when there is enough of it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define PARALLEL_MIN_ELEMS 65536

/* Sum of squares of n floats (n a multiple of 8) read through LOAD8. */
#define SUMSQ(LOAD8, x, n)                                                         \
    ({                                                                             \
        v8 acc_ = splat(0.0f);                                                     \
        for (int64_t i_ = 0; i_ < (n); i_ += 8) acc_ += LOAD8((x) + i_) * LOAD8((x) + i_); \
        hsum8(acc_);                                                               \
    })

/* out = act(gate) * up for the rows of x (gate then up, d each), act rounded where the reference
 * rounds it (bf16). */
#define ACT_AND_MUL(ACT8, ACT1, T, LD, ST, ROUND, LOAD8, STORE8, ROUND8)                                       \
    _Pragma("omp parallel for if (rows * d >= PARALLEL_MIN_ELEMS)") for (int64_t r = 0; r < rows; r++) {       \
        const T *g = x + r * 2 * d, *u = g + d;                                                                 \
        T *o = out + r * d;                                                                                     \
        int64_t i = 0;                                                                                          \
        for (; i + 8 <= d; i += 8) STORE8(o + i, ROUND8(ACT8(LOAD8(g + i))) * LOAD8(u + i));                    \
        for (; i < d; i++) o[i] = ST(ROUND(ACT1(LD(g[i]))) * LD(u[i]));                                         \
    }

#define DEFINE_FUSED_OPS(SUFFIX, T, LD, ST, ROUND, LOAD8, STORE8, ROUND8)                                       \
    void rms_norm_##SUFFIX(T *out, const T *x, const T *w, int64_t rows, int64_t dim, int64_t x_stride,      \
                           float eps) {                                                                          \
        _Pragma("omp parallel for if (rows * dim >= PARALLEL_MIN_ELEMS)") for (int64_t r = 0; r < rows; r++) { \
            const T *xr = x + r * x_stride;                                                                     \
            T *o = out + r * dim;                                                                               \
            const int64_t vec = dim & ~(int64_t)7;                                                              \
            float ss = SUMSQ(LOAD8, xr, vec);                                                                   \
            for (int64_t i = vec; i < dim; i++) ss += LD(xr[i]) * LD(xr[i]);                                    \
            const float inv = 1.0f / sqrtf(ss / (float)dim + eps);                                              \
            for (int64_t i = 0; i < vec; i += 8)                                                                \
                STORE8(o + i, LOAD8(w + i) * ROUND8(LOAD8(xr + i) * splat(inv)));                               \
            for (int64_t i = vec; i < dim; i++) o[i] = ST(LD(w[i]) * ROUND(LD(xr[i]) * inv));                   \
        }                                                                                                       \
    }                                                                                                           \
                                                                                                                \
    void add_rms_norm_##SUFFIX(T *x, T *residual, const T *w, int64_t rows, int64_t dim, float eps) {           \
        _Pragma("omp parallel for if (rows * dim >= PARALLEL_MIN_ELEMS)") for (int64_t r = 0; r < rows; r++) { \
            T *xr = x + r * dim, *rr = residual + r * dim;                                                      \
            const int64_t vec = dim & ~(int64_t)7;                                                              \
            for (int64_t i = 0; i < vec; i += 8) STORE8(rr + i, LOAD8(xr + i) + LOAD8(rr + i));                 \
            for (int64_t i = vec; i < dim; i++) rr[i] = ST(LD(xr[i]) + LD(rr[i]));                              \
            float ss = SUMSQ(LOAD8, rr, vec);                                                                   \
            for (int64_t i = vec; i < dim; i++) ss += LD(rr[i]) * LD(rr[i]);                                    \
            const float inv = 1.0f / sqrtf(ss / (float)dim + eps);                                              \
            for (int64_t i = 0; i < vec; i += 8)                                                                \
                STORE8(xr + i, LOAD8(w + i) * ROUND8(LOAD8(rr + i) * splat(inv)));                              \
            for (int64_t i = vec; i < dim; i++) xr[i] = ST(LD(w[i]) * ROUND(LD(rr[i]) * inv));                  \
        }                                                                                                       \
    }                                                                                                           \
                                                                                                                \
    static inline void rotate_##SUFFIX(T *x, const float *c, const float *s, int64_t half) {                    \
        int64_t i = 0;                                                                                          \
        for (; i + 8 <= half; i += 8) {                                                                         \
            const v8 x1 = LOAD8(x + i), x2 = LOAD8(x + i + half), cv = load8_f32(c + i), sv = load8_f32(s + i); \
            STORE8(x + i, x1 * cv - x2 * sv);                                                                   \
            STORE8(x + i + half, x2 * cv + x1 * sv);                                                            \
        }                                                                                                       \
        for (; i < half; i++) {                                                                                 \
            const float x1 = LD(x[i]), x2 = LD(x[i + half]);                                                    \
            x[i] = ST(x1 * c[i] - x2 * s[i]);                                                                   \
            x[i + half] = ST(x2 * c[i] + x1 * s[i]);                                                            \
        }                                                                                                       \
    }                                                                                                           \
                                                                                                                \
    void rotary_##SUFFIX(const int64_t *pos, T *q, T *k, const float *cache, int64_t tokens, int64_t q_heads,   \
                         int64_t k_heads, int64_t dim, int64_t q_stride, int64_t k_stride) {                    \
        const int64_t half = dim / 2;                                                                           \
        _Pragma("omp parallel for if (tokens * (q_heads + k_heads) * dim >= PARALLEL_MIN_ELEMS)")               \
        for (int64_t t = 0; t < tokens; t++) {                                                                  \
            const float *c = cache + pos[t] * dim, *s = c + half;                                               \
            for (int64_t h = 0; h < q_heads; h++) rotate_##SUFFIX(q + t * q_stride + h * dim, c, s, half);      \
            for (int64_t h = 0; h < k_heads; h++) rotate_##SUFFIX(k + t * k_stride + h * dim, c, s, half);      \
        }                                                                                                       \
    }                                                                                                           \
                                                                                                                \
    void silu_and_mul_##SUFFIX(T *out, const T *x, int64_t rows, int64_t d) {                                   \
        ACT_AND_MUL(silu8, silu1, T, LD, ST, ROUND, LOAD8, STORE8, ROUND8);                                     \
    }                                                                                                           \
                                                                                                                \
    void gelu_tanh_and_mul_##SUFFIX(T *out, const T *x, int64_t rows, int64_t d) {                              \
        ACT_AND_MUL(gelu_tanh8, gelu_tanh1, T, LD, ST, ROUND, LOAD8, STORE8, ROUND8);                           \
    }                                                                                                           \
                                                                                                                \
    /* New K/V rows into the paged cache (blocks, kv_heads, block_size, dim); slot < 0 is padding. */          \
    void write_kv_##SUFFIX(T *k_cache, T *v_cache, const T *k, const T *v, const int64_t *slots, int64_t tokens, \
                           int64_t heads, int64_t dim, int64_t block_size, int64_t k_stride, int64_t v_stride) {  \
        for (int64_t t = 0; t < tokens; t++) {                                                                  \
            const int64_t slot = slots[t];                                                                      \
            if (slot < 0) continue;                                                                             \
            const int64_t base = (slot / block_size) * heads * block_size + slot % block_size;                  \
            for (int64_t h = 0; h < heads; h++) {                                                               \
                const int64_t row = (base + h * block_size) * dim;                                              \
                memcpy(k_cache + row, k + t * k_stride + h * dim, dim * sizeof(T));                             \
                memcpy(v_cache + row, v + t * v_stride + h * dim, dim * sizeof(T));                             \
            }                                                                                                   \
        }                                                                                                       \
    }

DEFINE_FUSED_OPS(f32, float, id_f32, id_f32, id_f32, load8_f32, store8, round8_f32)
DEFINE_FUSED_OPS(bf16, uint16_t, from_bf16, to_bf16, round_bf16, load8_bf16, store8_bf16, round8_bf16)

/* out[r] = the index of row r's largest value, its first if several, or of its first NaN if it has
 * one (torch.argmax's answer), for rows of n floats `stride` apart. Two passes over each row (it
 * stays in L2): the largest value and whether there is a NaN, then the first index holding it.
 * torch's argmax took 210 us for 16 rows of a 49152-token vocabulary on this project's 2-core
 * machine (its amax 24): a greedy step's sampling, paid every step. */
void argmax_f32(int64_t *out, const float *x, int64_t rows, int64_t n, int64_t stride) {
    _Pragma("omp parallel for if (rows * n >= PARALLEL_MIN_ELEMS)") for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        vf best[4];
        vi nan[4];
        for (int a = 0; a < 4; a++) best[a] = splatf(-INFINITY), nan[a] = (vi){0};
        int64_t i = 0;
        for (; i + 4 * VL <= n; i += 4 * VL) /* four independent chains: a select's latency each */
            for (int a = 0; a < 4; a++) {
                vf v;
                memcpy(&v, row + i + a * VL, sizeof v);
                const vi up = v > best[a];
                best[a] = (vf)(((vi)v & up) | ((vi)best[a] & ~up));
                nan[a] |= v != v;
            }
        float m = -INFINITY;
        int any_nan = 0;
        for (int a = 0; a < 4; a++)
            for (int j = 0; j < VL; j++) m = best[a][j] > m ? best[a][j] : m, any_nan |= nan[a][j] != 0;
        for (int64_t j = i; j < n; j++) m = row[j] > m ? row[j] : m, any_nan |= row[j] != row[j];
        int64_t at = 0;
        for (; at + VL <= n; at += VL) { /* to the first VL holding it */
            vf v;
            memcpy(&v, row + at, sizeof v);
            const vi hit = any_nan ? v != v : v == splatf(m);
            int any = 0;
            for (int j = 0; j < VL; j++) any |= hit[j];
            if (any) break;
        }
        for (; at < n; at++)
            if (any_nan ? row[at] != row[at] : row[at] == m) break;
        out[r] = at < n ? at : 0;
    }
}
