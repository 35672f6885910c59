/*
 * Decode attention straight from the paged KV cache, for Kiln's CPU plugin.
 * The cache holds fp32 or bf16; queries, outputs and all arithmetic are fp32.
 *
 * One query token per request, one request per work item. K and V are read in
 * place through the block table (no gathered copy), in token order with all
 * heads of a token together, so each cache row streams through once; the query
 * heads sharing a kv head (the GQA group) reuse every K/V vector they load:
 *
 *   scores[h][g][t] = scale * q[h][g] . K[t][h]      t < seq_len
 *   p[h][g][t]      = softmax_t(scores[h][g][t])
 *   out[h][g]       = sum_t p[h][g][t] * V[t][h]
 *
 * The group size is made a compile-time constant (one specialisation per size
 * up to MAX_GROUP) so the per-head accumulators live in vector registers.
 *
 * Built at first use by kiln_cpu.native with the C compiler and OpenMP; the
 * loader resolves libgomp to the copy torch already loaded, so both share one
 * thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Eight floats; GCC/Clang lower it to AVX/AVX-512 or NEON as available. */
typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
#define MAX_GROUP 8

static inline v8 load8_f32(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* A bf16 is the top half of an fp32: widen by shifting into place. */
static inline v8 load8_bf16(const uint16_t *p) {
    u16x8 h;
    memcpy(&h, p, sizeof h);
    const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    v8 v;
    memcpy(&v, &w, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

static inline float hsum8(v8 a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

static void softmax_rows(float *scores, int64_t rows, int64_t len) {
    for (int64_t r = 0; r < rows; r++) {
        float *s = scores + r * len;
        float m = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < len; t++) m = s[t] > m ? s[t] : m;
        for (int64_t t = 0; t < len; t++) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
}

/* Everything that depends on the cache element type T, read eight at a time by LOAD. */
#define DEFINE_DECODE_ATTENTION(NAME, T, LOAD)                                                                   \
    /* scores[(h * group + g) * len + t] for every kv head h. */                                                 \
    static inline __attribute__((always_inline)) void scores_##NAME(                                             \
        float *scores, const float *q, const T *k_cache, const int32_t *table, int64_t len, int64_t kv_heads,    \
        int64_t head_dim, int64_t block_size, float scale, const int64_t group) {                               \
        const int64_t row = kv_heads * head_dim;                                                                 \
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                                       \
            const T *kb = k_cache + (int64_t)table[t0 / block_size] * block_size * row;                          \
            const int64_t n = len - t0 < block_size ? len - t0 : block_size;                                     \
            for (int64_t j = 0; j < n; j++) {                                                                    \
                for (int64_t h = 0; h < kv_heads; h++) {                                                         \
                    const T *k = kb + j * row + h * head_dim;                                                    \
                    const float *qh = q + h * group * head_dim;                                                  \
                    v8 acc[MAX_GROUP];                                                                           \
                    for (int64_t g = 0; g < group; g++) acc[g] = (v8){0};                                        \
                    for (int64_t i = 0; i < head_dim; i += 8) {                                                  \
                        const v8 kv = LOAD(k + i);                                                               \
                        for (int64_t g = 0; g < group; g++) acc[g] += load8_f32(qh + g * head_dim + i) * kv;     \
                    }                                                                                            \
                    for (int64_t g = 0; g < group; g++)                                                          \
                        scores[(h * group + g) * len + t0 + j] = scale * hsum8(acc[g]);                          \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
                                                                                                                 \
    /* out[h][g] = sum_t p[h][g][t] * V[t][h], reading V once, in token order. */                                \
    static inline __attribute__((always_inline)) void values_##NAME(                                             \
        float *out, const float *p, const T *v_cache, const int32_t *table, int64_t len, int64_t kv_heads,       \
        int64_t head_dim, int64_t block_size, const int64_t group) {                                            \
        const int64_t row = kv_heads * head_dim;                                                                 \
        memset(out, 0, kv_heads * group * head_dim * sizeof(float));                                             \
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                                      \
            const T *vb = v_cache + (int64_t)table[t0 / block_size] * block_size * row;                          \
            const int64_t n = len - t0 < block_size ? len - t0 : block_size;                                     \
            for (int64_t j = 0; j < n; j++) {                                                                    \
                for (int64_t h = 0; h < kv_heads; h++) {                                                         \
                    const T *v = vb + j * row + h * head_dim;                                                    \
                    float w[MAX_GROUP];                                                                          \
                    for (int64_t g = 0; g < group; g++) w[g] = p[(h * group + g) * len + t0 + j];                \
                    for (int64_t i = 0; i < head_dim; i += 8) {                                                  \
                        const v8 vv = LOAD(v + i);                                                               \
                        for (int64_t g = 0; g < group; g++) {                                                    \
                            float *o = out + (h * group + g) * head_dim + i;                                     \
                            store8(o, load8_f32(o) + w[g] * vv);                                                 \
                        }                                                                                        \
                    }                                                                                            \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
                                                                                                                 \
    /* Returns 0, or -1 for shapes this kernel does not handle (the caller falls back). */                       \
    int paged_decode_attention_##NAME(float *out, const float *q, const T *k_cache, const T *v_cache,            \
                                      const int32_t *block_table, int64_t table_stride, const int32_t *seq_lens, \
                                      int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,                 \
                                      int64_t head_dim, int64_t block_size, float scale) {                       \
        const int64_t group = num_heads / num_kv_heads;                                                          \
        if (head_dim % 8 != 0 || group < 1 || group > MAX_GROUP || group * num_kv_heads != num_heads) return -1; \
        _Pragma("omp parallel") {                                                                                \
            float *scores = NULL;                                                                                \
            int64_t capacity = 0;                                                                                \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t r = 0; r < num_reqs; r++) {                     \
                const int64_t len = seq_lens[r];                                                                 \
                if (len * num_heads > capacity) {                                                                \
                    free(scores);                                                                                \
                    capacity = len * num_heads;                                                                  \
                    scores = (float *)malloc(capacity * sizeof(float));                                          \
                }                                                                                                \
                const int32_t *table = block_table + r * table_stride;                                           \
                const float *qr = q + r * num_heads * head_dim;                                                  \
                float *outr = out + r * num_heads * head_dim;                                                    \
                switch (group) {                                                                                 \
                    SPECIALISE(NAME, 1) SPECIALISE(NAME, 2) SPECIALISE(NAME, 3) SPECIALISE(NAME, 4)              \
                    SPECIALISE(NAME, 5) SPECIALISE(NAME, 6) SPECIALISE(NAME, 7) SPECIALISE(NAME, 8)              \
                }                                                                                                \
            }                                                                                                    \
            free(scores);                                                                                        \
        }                                                                                                        \
        return 0;                                                                                                \
    }

#define SPECIALISE(NAME, G)                                                                               \
    case G:                                                                                              \
        scores_##NAME(scores, qr, k_cache, table, len, num_kv_heads, head_dim, block_size, scale, G);    \
        softmax_rows(scores, num_heads, len);                                                            \
        values_##NAME(outr, scores, v_cache, table, len, num_kv_heads, head_dim, block_size, G);         \
        break;

DEFINE_DECODE_ATTENTION(f32, float, load8_f32)
DEFINE_DECODE_ATTENTION(bf16, uint16_t, load8_bf16)
