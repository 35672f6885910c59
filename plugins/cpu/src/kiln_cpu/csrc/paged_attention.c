/*
 * Decode attention straight from the paged KV cache (fp32), for Kiln's CPU plugin.
 *
 * One query token per request. For each (request, kv head) the query heads that
 * share the kv head (the GQA group) are processed together, so K and V are read
 * in place through the block table, without gathering them into a copy:
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

struct Shape {
    const int32_t *table; /* this request's block ids */
    int64_t len, row, head_dim, block_size;
    float scale;
};

/* scores[g * len + t] for one (request, kv head); q points at the group's first head. */
static inline __attribute__((always_inline)) void group_scores(float *scores, const float *q, const float *k_cache,
                                                               struct Shape s, const int64_t group) {
    for (int64_t t0 = 0; t0 < s.len; t0 += s.block_size) {
        const float *kb = k_cache + (int64_t)s.table[t0 / s.block_size] * s.block_size * s.row;
        const int64_t n = s.len - t0 < s.block_size ? s.len - t0 : s.block_size;
        for (int64_t j = 0; j < n; j++) {
            const float *k = kb + j * s.row;
            v8 acc[MAX_GROUP];
            for (int64_t g = 0; g < group; g++) acc[g] = (v8){0};
            for (int64_t i = 0; i < s.head_dim; i += 8) {
                const v8 kv = load8(k + i);
                for (int64_t g = 0; g < group; g++) acc[g] += load8(q + g * s.head_dim + i) * kv;
            }
            for (int64_t g = 0; g < group; g++) scores[g * s.len + t0 + j] = s.scale * hsum8(acc[g]);
        }
    }
}

/* out[g] = sum_t p[g][t] * V[t], eight output lanes at a time. */
static inline __attribute__((always_inline)) void group_values(float *out, const float *p, const float *v_cache,
                                                               struct Shape s, const int64_t group) {
    for (int64_t i = 0; i < s.head_dim; i += 8) {
        v8 acc[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) acc[g] = (v8){0};
        for (int64_t t0 = 0; t0 < s.len; t0 += s.block_size) {
            const float *vb = v_cache + (int64_t)s.table[t0 / s.block_size] * s.block_size * s.row + i;
            const int64_t n = s.len - t0 < s.block_size ? s.len - t0 : s.block_size;
            for (int64_t j = 0; j < n; j++) {
                const v8 vv = load8(vb + j * s.row);
                for (int64_t g = 0; g < group; g++) acc[g] += p[g * s.len + t0 + j] * vv;
            }
        }
        for (int64_t g = 0; g < group; g++) store8(out + g * s.head_dim + i, acc[g]);
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

#define SPECIALISE(G)                                      \
    case G:                                                \
        group_scores(scores, qh, kh, s, G);                \
        softmax_rows(scores, G, s.len);                    \
        group_values(oh, scores, vh, s, G);                \
        break;

/* Returns 0, or -1 for shapes this kernel does not handle (the caller falls back). */
int paged_decode_attention_f32(float *out, const float *q, const float *k_cache, const float *v_cache,
                               const int32_t *block_table, int64_t table_stride, const int32_t *seq_lens,
                               int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    if (head_dim % 8 != 0 || group < 1 || group > MAX_GROUP) return -1;
    const int64_t row = num_kv_heads * head_dim; /* floats per token in one cache plane */

#pragma omp parallel
    {
        float *scores = NULL;
        int64_t capacity = 0;

#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < num_reqs; r++) {
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const int64_t len = seq_lens[r];
                if (len * group > capacity) {
                    free(scores);
                    capacity = len * group;
                    scores = (float *)malloc(capacity * sizeof(float));
                }
                struct Shape s = {block_table + r * table_stride, len, row, head_dim, block_size, scale};
                const float *qh = q + (r * num_heads + h * group) * head_dim;
                float *oh = out + (r * num_heads + h * group) * head_dim;
                const float *kh = k_cache + h * head_dim, *vh = v_cache + h * head_dim;
                switch (group) {
                    SPECIALISE(1) SPECIALISE(2) SPECIALISE(3) SPECIALISE(4)
                    SPECIALISE(5) SPECIALISE(6) SPECIALISE(7) SPECIALISE(8)
                }
            }
        }
        free(scores);
    }
    return 0;
}
