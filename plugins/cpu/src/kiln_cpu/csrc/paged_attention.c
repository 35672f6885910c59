/*
 * Decode attention straight from the paged KV cache, for Kiln's CPU plugin.
 * Queries and outputs are fp32 or bf16, the cache their dtype or bf16 under fp32
 * queries (--kv-cache-dtype bfloat16: half the memory); all arithmetic is fp32.
 * Query rows may be strided (they are views into the fused qkv projection).
 *
 * Cache layout, per plane (K or V): (blocks, kv_heads, block_size, head_dim), so
 * one head's rows in one block are contiguous. One query token per request. K and
 * V are read in place through the block table (no gathered copy). Work is split
 * by (request, kv head); the query heads sharing a kv head (the GQA group) reuse
 * every K/V vector they load:
 *
 *   s[g][t] = scale * q[g] . K[t]      t < seq_len
 *   p[g][t] = exp(s[g][t] - max_t s[g][t])
 *   out[g]  = sum_t p[g][t] * V[t] / sum_t p[g][t]
 *
 * Group size G and head size D are compile-time constants (one function per
 * pair), so q and the output accumulators stay in vector registers.
 *
 * Built at first use by kiln_cpu.native with the C compiler and OpenMP; the
 * loader resolves libgomp to the copy torch already loaded, so both share one
 * thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

/* p[t] = exp(s[t] - max s) over a row padded with -inf to a multiple of 8; returns sum p. */
static inline float softmax_numerators(float *s, int64_t padded) {
    v8 m = splat(-INFINITY);
    for (int64_t t = 0; t < padded; t += 8) m = vmax(m, load8_f32(s + t));
    float mx = m[0];
    for (int i = 1; i < 8; i++) mx = m[i] > mx ? m[i] : mx;
    v8 sum = splat(0.0f);
    for (int64_t t = 0; t < padded; t += 8) {
        const v8 e = exp8_nonpositive(load8_f32(s + t) - splat(mx));
        store8(s + t, e);
        sum += e;
    }
    return hsum8(sum);
}

/* One (request, kv head): out[g][:] for g < G. k and v point at this head's rows in
 * block 0; `row` is the stride between blocks / block_size; scores has room for G
 * rows of `padded` floats. */
#define DEFINE_HEAD(NAME, T, LOAD, STORE, KT, KLOAD, G, D)                                                       \
    static void head_##NAME##_##G##_##D(T *out, const T *q, const KT *k, const KT *v,                          \
                                        const int32_t *table, int64_t len, int64_t row, int64_t block_size,     \
                                        float scale, float *scores, int64_t padded) {                           \
        v16 qv[G][D / 16];                                                                                       \
        for (int g = 0; g < G; g++)                                                                              \
            for (int c = 0; c < D / 16; c++) qv[g][c] = LOAD(q + g * D + 16 * c) * splat16(scale);              \
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                                       \
            const KT *kb = k + (int64_t)table[t0 / block_size] * block_size * row;                               \
            const int64_t n = len - t0 < block_size ? len - t0 : block_size;                                     \
            for (int64_t j = 0; j < n; j++) {                                                                    \
                v16 acc[G];                                                                                      \
                for (int g = 0; g < G; g++) acc[g] = splat16(0.0f);                                              \
                for (int c = 0; c < D / 16; c++) {                                                               \
                    const v16 kv = KLOAD(kb + j * D + 16 * c);                                                   \
                    for (int g = 0; g < G; g++) acc[g] += qv[g][c] * kv;                                         \
                }                                                                                                \
                for (int g = 0; g < G; g++) scores[g * padded + t0 + j] = hsum16(acc[g]);                       \
            }                                                                                                    \
        }                                                                                                        \
        float inv[G];                                                                                            \
        for (int g = 0; g < G; g++) {                                                                            \
            for (int64_t t = len; t < padded; t++) scores[g * padded + t] = -INFINITY;                           \
            inv[g] = 1.0f / softmax_numerators(scores + g * padded, padded);                                    \
        }                                                                                                        \
        v16 o[G][D / 16];                                                                                        \
        for (int g = 0; g < G; g++)                                                                              \
            for (int c = 0; c < D / 16; c++) o[g][c] = splat16(0.0f);                                            \
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                                       \
            const KT *vb = v + (int64_t)table[t0 / block_size] * block_size * row;                               \
            const int64_t n = len - t0 < block_size ? len - t0 : block_size;                                     \
            for (int64_t j = 0; j < n; j++) {                                                                    \
                v16 w[G];                                                                                        \
                for (int g = 0; g < G; g++) w[g] = splat16(scores[g * padded + t0 + j]);                         \
                for (int c = 0; c < D / 16; c++) {                                                               \
                    const v16 vv = KLOAD(vb + j * D + 16 * c);                                                   \
                    for (int g = 0; g < G; g++) o[g][c] += w[g] * vv;                                            \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        for (int g = 0; g < G; g++)                                                                              \
            for (int c = 0; c < D / 16; c++) STORE(out + g * D + 16 * c, o[g][c] * splat16(inv[g]));            \
    }


#define DEFINE_HEADS(NAME, T, LOAD, STORE, KT, KLOAD, D)                                                         \
    DEFINE_HEAD(NAME, T, LOAD, STORE, KT, KLOAD, 1, D)                                                           \
    DEFINE_HEAD(NAME, T, LOAD, STORE, KT, KLOAD, 2, D)                                                           \
    DEFINE_HEAD(NAME, T, LOAD, STORE, KT, KLOAD, 3, D)                                                           \
    DEFINE_HEAD(NAME, T, LOAD, STORE, KT, KLOAD, 4, D)                                                           \
    DEFINE_HEAD(NAME, T, LOAD, STORE, KT, KLOAD, 5, D)                                                           \
    DEFINE_HEAD(NAME, T, LOAD, STORE, KT, KLOAD, 6, D)                                                           \
    DEFINE_HEAD(NAME, T, LOAD, STORE, KT, KLOAD, 7, D)                                                           \
    DEFINE_HEAD(NAME, T, LOAD, STORE, KT, KLOAD, 8, D)                                                           \
    static const head_fn_##NAME heads_##NAME##_##D[9] = {NULL,                  head_##NAME##_1_##D,             \
                                                          head_##NAME##_2_##D,  head_##NAME##_3_##D,             \
                                                          head_##NAME##_4_##D,  head_##NAME##_5_##D,             \
                                                          head_##NAME##_6_##D,  head_##NAME##_7_##D,             \
                                                          head_##NAME##_8_##D};

/* The entry point for cache element type T: returns 0, or -1 for shapes this kernel
 * does not handle (the caller then falls back to torch). */
#define DEFINE_DECODE_ATTENTION(NAME, T, LOAD, STORE, KT, KLOAD)                                                 \
    typedef void (*head_fn_##NAME)(T *, const T *, const KT *, const KT *, const int32_t *, int64_t, int64_t,    \
                                   int64_t, float, float *, int64_t);                                            \
    DEFINE_HEADS(NAME, T, LOAD, STORE, KT, KLOAD, 64)                                                            \
    DEFINE_HEADS(NAME, T, LOAD, STORE, KT, KLOAD, 128)                                                           \
    int paged_decode_attention_##NAME(T *out, const T *q, int64_t q_stride, const KT *k_cache,                   \
                                      const KT *v_cache,                                                         \
                                      const int32_t *block_table, int64_t table_stride, const int32_t *seq_lens, \
                                      int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,                 \
                                      int64_t head_dim, int64_t block_size, float scale) {                       \
        const int64_t group = num_heads / num_kv_heads;                                                          \
        if (group < 1 || group > 8 || group * num_kv_heads != num_heads) return -1;                              \
        if (head_dim != 64 && head_dim != 128) return -1;                                                        \
        const head_fn_##NAME fn = head_dim == 64 ? heads_##NAME##_64[group] : heads_##NAME##_128[group];         \
        const int64_t row = num_kv_heads * head_dim;                                                             \
        _Pragma("omp parallel") {                                                                                \
            float *scores = NULL;                                                                                \
            int64_t capacity = 0;                                                                                \
            _Pragma("omp for collapse(2) schedule(dynamic, 4)") for (int64_t r = 0; r < num_reqs; r++) {         \
                for (int64_t h = 0; h < num_kv_heads; h++) {                                                     \
                    const int64_t len = seq_lens[r], padded = (len + 7) / 8 * 8;                                 \
                    if (padded * group > capacity) {                                                             \
                        free(scores);                                                                            \
                        capacity = padded * group;                                                               \
                        scores = (float *)malloc(capacity * sizeof(float));                                      \
                    }                                                                                            \
                    const int64_t first = (r * num_heads + h * group) * head_dim;                                \
                    fn(out + first, q + r * q_stride + h * group * head_dim, k_cache + h * block_size * head_dim, v_cache + h * block_size * head_dim,                   \
                       block_table + r * table_stride, len, row, block_size, scale, scores, padded);             \
                }                                                                                                \
            }                                                                                                    \
            free(scores);                                                                                        \
        }                                                                                                        \
        return 0;                                                                                                \
    }

DEFINE_DECODE_ATTENTION(f32, float, load16_f32, store16_f32, float, load16_f32)
DEFINE_DECODE_ATTENTION(bf16, uint16_t, load16_bf16, store16_bf16, uint16_t, load16_bf16)
DEFINE_DECODE_ATTENTION(f32_bf16, float, load16_f32, store16_f32, uint16_t, load16_bf16)
