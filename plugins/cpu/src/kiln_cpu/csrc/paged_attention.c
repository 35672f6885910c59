/*
 * Decode attention straight from the paged KV cache (fp32), for Kiln's CPU plugin.
 *
 * One query token per request, one request per work item. K and V are read in
 * place through the block table (no gathered copy), in token order with all
 * heads of a token together, so each cache row streams through once; the query
 * heads sharing a kv head (the GQA group) reuse every K/V vector they load:
 *
 *   scores[g][t] = scale * q[g] . K[t]       t < seq_len
 *   p[g][t]      = softmax_t(scores[g][t])
 *   out[g]       = sum_t p[g][t] * V[t]
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
#define MAX_GROUP 8

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

static inline float hsum8(v8 a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

/* scores[(h * group + g) * len + t] = scale * q[h][g] . K[t][h] for every kv head h. */
static inline __attribute__((always_inline)) void request_scores(float *scores, const float *q, const float *k_cache,
                                                                 const int32_t *table, int64_t len, int64_t kv_heads,
                                                                 int64_t head_dim, int64_t block_size, float scale,
                                                                 const int64_t group) {
    const int64_t row = kv_heads * head_dim;
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const float *kb = k_cache + (int64_t)table[t0 / block_size] * block_size * row;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        for (int64_t j = 0; j < n; j++) {
            for (int64_t h = 0; h < kv_heads; h++) {
                const float *k = kb + j * row + h * head_dim;
                const float *qh = q + h * group * head_dim;
                v8 acc[MAX_GROUP];
                for (int64_t g = 0; g < group; g++) acc[g] = (v8){0};
                for (int64_t i = 0; i < head_dim; i += 8) {
                    const v8 kv = load8(k + i);
                    for (int64_t g = 0; g < group; g++) acc[g] += load8(qh + g * head_dim + i) * kv;
                }
                for (int64_t g = 0; g < group; g++) scores[(h * group + g) * len + t0 + j] = scale * hsum8(acc[g]);
            }
        }
    }
}

/* out[h][g] = sum_t p[h][g][t] * V[t][h], reading V once, in token order. */
static inline __attribute__((always_inline)) void request_values(float *out, const float *p, const float *v_cache,
                                                                 const int32_t *table, int64_t len, int64_t kv_heads,
                                                                 int64_t head_dim, int64_t block_size,
                                                                 const int64_t group) {
    const int64_t row = kv_heads * head_dim;
    memset(out, 0, kv_heads * group * head_dim * sizeof(float));
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const float *vb = v_cache + (int64_t)table[t0 / block_size] * block_size * row;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        for (int64_t j = 0; j < n; j++) {
            for (int64_t h = 0; h < kv_heads; h++) {
                const float *v = vb + j * row + h * head_dim;
                float w[MAX_GROUP];
                for (int64_t g = 0; g < group; g++) w[g] = p[(h * group + g) * len + t0 + j];
                for (int64_t i = 0; i < head_dim; i += 8) {
                    const v8 vv = load8(v + i);
                    for (int64_t g = 0; g < group; g++) {
                        float *o = out + (h * group + g) * head_dim + i;
                        store8(o, load8(o) + w[g] * vv);
                    }
                }
            }
        }
    }
}

static void softmax_rows(float *scores, int64_t rows, int64_t len) {
    for (int64_t g = 0; g < rows; g++) {
        float *sg = scores + g * len;
        float m = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;
        for (int64_t t = 0; t < len; t++) {
            sg[t] = expf(sg[t] - m);
            sum += sg[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; t++) sg[t] *= inv;
    }
}

#define SPECIALISE(G)                                                                                   \
    case G:                                                                                             \
        request_scores(scores, qr, k_cache, table, len, num_kv_heads, head_dim, block_size, scale, G); \
        softmax_rows(scores, num_heads, len);                                                           \
        request_values(outr, scores, v_cache, table, len, num_kv_heads, head_dim, block_size, G);      \
        break;

/* Returns 0, or -1 for shapes this kernel does not handle (the caller falls back). */
int paged_decode_attention_f32(float *out, const float *q, const float *k_cache, const float *v_cache,
                               const int32_t *block_table, int64_t table_stride, const int32_t *seq_lens,
                               int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    if (head_dim % 8 != 0 || group < 1 || group > MAX_GROUP) return -1;

#pragma omp parallel
    {
        float *scores = NULL;
        int64_t capacity = 0;

#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < num_reqs; r++) {
            const int64_t len = seq_lens[r];
            if (len * num_heads > capacity) {
                free(scores);
                capacity = len * num_heads;
                scores = (float *)malloc(capacity * sizeof(float));
            }
            const int32_t *table = block_table + r * table_stride;
            const float *qr = q + r * num_heads * head_dim;
            float *outr = out + r * num_heads * head_dim;
            switch (group) {
                SPECIALISE(1) SPECIALISE(2) SPECIALISE(3) SPECIALISE(4)
                SPECIALISE(5) SPECIALISE(6) SPECIALISE(7) SPECIALISE(8)
            }
        }
        free(scores);
    }
    return 0;
}
