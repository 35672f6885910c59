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
 * every K/V vector they load. With a sliding window w (0: none) the query, at
 * position seq_len - 1, sees only the last w keys: first = max(0, seq_len - w),
 * and blocks wholly before it are not read. With a soft cap c (Gemma 2's; 0: none) each
 * score becomes c tanh(s / c) before the softmax.
 *
 *   s[g][t] = scale * q[g] . K[t]      first <= t < seq_len
 *   p[g][t] = exp(s[g][t] - max_t s[g][t])
 *   out[g]  = sum_t p[g][t] * V[t] / sum_t p[g][t]
 *
 * Head size D is a compile-time constant (one function per size), so the loops
 * over it unroll into vector registers; K/V are read in fp32 (widened per block
 * from a bf16 cache). The products run on 16-float vectors where the compiler
 * targets AVX-512, else 8: with AVX-512, 64 decodes of ~190 keys ran in 0.6x the
 * time (half the instructions; the cache's reads were not the bound).
 *
 * Built at first use by kiln_cpu.native with the C compiler and OpenMP; the
 * loader resolves libgomp to the copy torch already loaded, so both share one
 * thread pool. Its 16 kernels (4 element types, 4 head sizes) are instantiated
 * in two files, paged_attention.c and paged_attention_narrow.c, which compile
 * side by side: GCC took ~17 s over them in one.
 */
#ifndef KILN_PAGED_ATTENTION_H
#define KILN_PAGED_ATTENTION_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

typedef uint32_t vu __attribute__((vector_size(4 * VL)));

/* a vf's lanes folded into eight partial sums */
static inline v8 fold8(vf a) {
#if VL == 16
    return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    return a;
#endif
}

/* Lane i: the sum of a[i]'s lanes. */
static inline v8 sum_each(const vf a[8]) {
    v8 h[8];
    for (int i = 0; i < 8; i++) h[i] = fold8(a[i]);
    return sum_each8(h);
}

/* p[t] = exp(s[t] - max s) over a row padded with -inf to a multiple of 8; returns sum p, and
 * max s in *max. */
static inline float softmax_numerators(float *s, int64_t padded, float *max) {
    v8 m = splat(-INFINITY);
    for (int64_t t = 0; t < padded; t += 8) m = vmax(m, load8_f32(s + t));
    float mx = m[0];
    for (int i = 1; i < 8; i++) mx = m[i] > mx ? m[i] : mx;
    *max = mx;
    v8 sum = splat(0.0f);
    for (int64_t t = 0; t < padded; t += 8) {
        const v8 e = exp8_nonpositive(load8_f32(s + t) - splat(mx));
        store8(s + t, e);
        sum += e;
    }
    return hsum8(sum);
}

/* Ask for one head's rows of a block ahead of use: blocks lie scattered in a large pool,
 * and with the weights streaming through the caches every layer, each read would else
 * wait on memory (measured: 16 decodes x 260 keys took 2.6x longer than from cache).
 * The loops below ask for the block two ahead of the one they multiply (keys, then values):
 * one ahead left the reads waiting once the products ran on AVX-512 (64 decodes of ~190
 * keys, 1.1x as long). NOTE: GCC 12 dropped every prefetch of a helper that picked the
 * block of a keys-then-values walk (objdump showed none), so the blocks are spelled out.
 * A block is asked for a few lines at a time between the products (ask), not all at once:
 * a block's 32-64 requests in a row waited on the core's line fill buffers (a third of the
 * kernel's samples sat on the instruction after a prefetch), and the products behind them
 * with them. On a 2-core AVX-512 Xeon, 64 decodes of 192 keys through 30 layers from memory
 * (bf16 cache, blocks of 32) took 19.4-21.8 ms against 22.9-27.1, five runs each alternated;
 * level with K/V in L2. */
typedef struct {
    const char *at, *end;
} Ahead;

static inline Ahead ahead_of(const void *p, int64_t bytes) { return (Ahead){(const char *)p, (const char *)p + bytes}; }

static inline void ask(Ahead *a, int lines) {
    for (int i = 0; i < lines && a->at < a->end; i++, a->at += 64) __builtin_prefetch(a->at);
}

/* n cache values as fp32: the cache itself, or a bf16 cache widened into `tmp` once per
 * block, so the loops below (which read each block G times) do not widen it G times.
 * bf16 goes two values to a 32-bit word: each run of 2 VL values is one load, its even values
 * shifted into place and its odd ones masked (where widening VL at a time takes a load, a
 * widening and a shift each). With AVX2, 64 decodes of 192 keys through 30 layers took 8.6-9.2
 * ms against 11.0-11.5 with the cache in L3, 16.8-17.8 against 17.9-20.0 from memory; AVX-512
 * builds gained less (8.2-8.8 -> 7.6-8.0 ms from L3, level from memory). The run's
 * values come out permuted, evens then odds (`permute`); the head kernel permutes its queries
 * the same way and puts its outputs back. */
static inline const float *widen_f32(const float *src, float *tmp, int64_t n) {
    (void)tmp, (void)n;
    return src;
}

static inline const float *widen_bf16(const uint16_t *src, float *tmp, int64_t n) {
    for (int64_t i = 0; i < n; i += 2 * VL) {
        vu w;
        memcpy(&w, src + i, sizeof w);
        const vu even = w << 16, odd = w & 0xffff0000u;
        memcpy(tmp + i, &even, sizeof even);
        memcpy(tmp + i + VL, &odd, sizeof odd);
    }
    return tmp;
}

/* An fp8 e5m2 cache (--kv-cache-dtype fp8_e5m2): each byte is the top half of an fp16, so a
 * shift makes it one and F16C widens it, in order (no permutation). */
static inline const float *widen_e5m2(const uint8_t *src, float *tmp, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) {
#if defined(__F16C__)
        store8(tmp + i, (v8)_mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(src + i))), 8)));
#else
        for (int k = 0; k < 8; k++) {
            const uint16_t bits = (uint16_t)(src[i + k] << 8);
            _Float16 h;
            memcpy(&h, &bits, sizeof h);
            tmp[i + k] = (float)h;
        }
#endif
    }
    return tmp;
}

/* n floats (a multiple of 2 VL) into widen_bf16's order, or (back) out of it. */
static void permute(float *x, int64_t n, int back) {
    float run[2 * VL];
    for (int64_t i = 0; i < n; i += 2 * VL) {
        memcpy(run, x + i, sizeof run);
        for (int k = 0; k < VL; k++) {
            if (back) {
                x[i + 2 * k] = run[k], x[i + 2 * k + 1] = run[VL + k];
            } else {
                x[i + k] = run[2 * k], x[i + VL + k] = run[2 * k + 1];
            }
        }
    }
}

/* One (request, kv head) over keys first..len-1 (all of them, or a split's: see
 * DEFINE_DECODE_ATTENTION): for each of the G query heads of the group, acc[g][:] = sum_t p[g][t] V[t]
 * with p[g][t] = exp(s[g][t] - m[g]), and ml[g] = m[g] = max_t s[g][t], ml[G + g] = sum_t p[g][t]
 * (the output is acc[g] / ml[G + g]). k and v point at this head's rows in block 0; `row` is the stride between
 * blocks / block_size; keys are read from `base` (first rounded down to a block) on, and
 * score t - base of each of the G rows of `padded` floats in scores is key t's; tmp has
 * room for block_size rows of D. G is a loop
 * outside the unrolled ones over D: each pass over a block re-reads it from L1 (a
 * block is a few KB), not from memory.
 *   QK: eight keys at a time, one accumulator per key, summed across lanes together.
 *   PV: per head, 64 output dims at a time held in 64 / VL accumulators (32 at a time for
 *       Phi-3's 96). */
#define PV_DIMS(D) ((D) % 64 ? 32 : 64)
#define DEFINE_HEAD(NAME, T, LOAD, STORE, KT, WIDEN, PERMUTED, D)                                                \
    static void head_##NAME##_##D(float *acc, float *ml, const T *q, const KT *k, const KT *v,                   \
                                  const int32_t *table, int64_t first, int64_t base, int64_t len, int64_t row,   \
                                  int64_t block_size, float scale, float softcap, float *scores, int64_t padded, \
                                  int64_t G, float *tmp) {                                                       \
        float qf[8 * D];                                                                                         \
        for (int64_t i = 0; i < G * D; i += 8) {                                                                 \
            store8(qf + i, LOAD(q + i) * splat(scale));                                                          \
            store8(acc + i, splat(0.0f));                                                                        \
        }                                                                                                        \
        if (PERMUTED) permute(qf, G * D, 0);                                                                     \
        const int64_t block_bytes = block_size * D * (int64_t)sizeof(KT);                                      \
        /* the block after the first, at once: the second keys, or with one key block the first values */      \
        Ahead one = base + block_size < len                                                                      \
                        ? ahead_of(k + (int64_t)table[base / block_size + 1] * block_size * row, block_bytes)      \
                        : ahead_of(v + (int64_t)table[base / block_size] * block_size * row, block_bytes);         \
        ask(&one, INT32_MAX);                                                                                    \
        for (int64_t t0 = base; t0 < len; t0 += block_size) {                                                    \
            const int64_t n = len - t0 < block_size ? len - t0 : block_size;                                     \
            Ahead two = ahead_of(NULL, 0); /* two ahead: keys, or at the last key block the second values */     \
            if (t0 + 2 * block_size < len)                                                                       \
                two = ahead_of(k + (int64_t)table[(t0 + 2 * block_size) / block_size] * block_size * row, block_bytes); \
            else if (t0 + block_size >= len && base + block_size < len)                                          \
                two = ahead_of(v + (int64_t)table[base / block_size + 1] * block_size * row, block_bytes);          \
            else if (t0 + block_size < len) /* the last key block next: the first values */                      \
                two = ahead_of(v + (int64_t)table[base / block_size] * block_size * row, block_bytes);              \
            const float *kb = WIDEN(k + (int64_t)table[t0 / block_size] * block_size * row, tmp, n * D);          \
            const int per = n >= 8 ? (int)(block_bytes / 64 / (n / 8 * G)) + 1 : 0; /* lines per 8 keys */    \
            for (int64_t g = 0; g < G; g++) {                                                                    \
                const float *qg = qf + g * D;                                                                    \
                float *s = scores + g * padded + (t0 - base);                                                    \
                int64_t j = 0;                                                                                   \
                for (; j + 8 <= n; j += 8) {                                                                     \
                    ask(&two, per);                                                                              \
                    vf a[8];                                                                                     \
                    for (int i = 0; i < 8; i++) a[i] = splatf(0.0f);                                             \
                    for (int c = 0; c < D; c += VL) {                                                            \
                        const vf qc = loadf(qg + c);                                                             \
                        for (int i = 0; i < 8; i++) a[i] += qc * loadf(kb + (j + i) * D + c);                     \
                    }                                                                                            \
                    store8(s + j, sum_each(a));                                                                  \
                }                                                                                                \
                for (; j < n; j++) {                                                                             \
                    vf a = splatf(0.0f);                                                                         \
                    for (int c = 0; c < D; c += VL) a += loadf(qg + c) * loadf(kb + j * D + c);                   \
                    s[j] = hsum8(fold8(a));                                                                      \
                }                                                                                                \
            }                                                                                                    \
            ask(&two, INT32_MAX);                                                                                \
        }                                                                                                        \
        for (int64_t g = 0; g < G; g++) {                                                                        \
            if (softcap > 0.0f)                                                                                  \
                for (int64_t t = 0; t < padded; t += 8)                                                          \
                    store8(scores + g * padded + t, softcap8(load8_f32(scores + g * padded + t), softcap));      \
            for (int64_t t = 0; t < first - base; t++) scores[g * padded + t] = -INFINITY;                       \
            for (int64_t t = len - base; t < padded; t++) scores[g * padded + t] = -INFINITY;                    \
            ml[G + g] = softmax_numerators(scores + g * padded, padded, ml + g);                                 \
        }                                                                                                        \
        for (int64_t t0 = base; t0 < len; t0 += block_size) {                                                    \
            const int64_t n = len - t0 < block_size ? len - t0 : block_size;                                     \
            Ahead two = ahead_of(NULL, 0);                                                                       \
            if (t0 + 2 * block_size < len)                                                                       \
                two = ahead_of(v + (int64_t)table[(t0 + 2 * block_size) / block_size] * block_size * row, block_bytes); \
            const float *vb = WIDEN(v + (int64_t)table[t0 / block_size] * block_size * row, tmp, n * D);          \
            for (int64_t g = 0; g < G; g++) {                                                                    \
                const float *p = scores + g * padded + (t0 - base);                                              \
                for (int c0 = 0; c0 < D; c0 += PV_DIMS(D)) {                                                     \
                    float *og = acc + g * D + c0;                                                                \
                    vf o[64 / VL];                                                                               \
                    for (int c = 0; c < PV_DIMS(D) / VL; c++) o[c] = loadf(og + VL * c);                         \
                    for (int64_t j = 0; j < n; j++) {                                                            \
                        ask(&two, 1);                                                                            \
                        const vf w = splatf(p[j]);                                                               \
                        for (int c = 0; c < PV_DIMS(D) / VL; c++) o[c] += w * loadf(vb + j * D + c0 + VL * c);    \
                    }                                                                                            \
                    for (int c = 0; c < PV_DIMS(D) / VL; c++) storef(og + VL * c, o[c]);                         \
                }                                                                                                \
            }                                                                                                    \
            ask(&two, INT32_MAX);                                                                                \
        }                                                                                                        \
        if (PERMUTED) permute(acc, G * D, 1);                                                                    \
    }

/* Few (request, kv head) items leave a thread idle: one request of the default model is 3 items
 * on 2 threads, whose keys one took 2 of (0.86-0.94 ms over 30 layers of 384 keys from memory in the
 * AVX2 build, 3.7-3.8 ms at 2048 keys). Under SPLIT_ITEMS items a thread, each item's keys are split
 * into runs of whole cache blocks (SPLIT_MIN_BLOCKS at least), each run a work item of its own; the
 * runs' sums are merged as one softmax over all keys (merge_splits). One request: 0.82-0.88x the time at
 * 640-4096 keys (AVX2 and AVX-512 builds); runs of 2 blocks cost more than they gained at 384. */
#define SPLIT_ITEMS 8
#define SPLIT_MIN_BLOCKS 8

/* The cache blocks an item's keys span up to len: from *base, the first key a sliding window of
 * `window` leaves (*start; 0: none) rounded down to a block. */
static inline int64_t key_blocks(int64_t len, int64_t window, int64_t block_size, int64_t *start, int64_t *base) {
    *start = window > 0 && len > window ? len - window : 0;
    *base = *start / block_size * block_size;
    return (len - *base + block_size - 1) / block_size;
}

/* The runs an item of `blocks` cache blocks is split into, `splits` at most. */
static inline int64_t item_splits(int64_t blocks, int64_t splits) {
    const int64_t most = blocks / SPLIT_MIN_BLOCKS;
    return splits < most ? splits : most > 1 ? most : 1;
}

/* o[g][:] (G x D fp32) of an item from the sums its n runs left (p: n parts of `stride` floats, each
 * head_*'s acc then ml): every run's weighted by exp(its max - the max of all), over the weighted sum
 * of their softmax denominators. One run: acc / its denominator, as unsplit. Overwrites each run's
 * maxima with those weights. */
static void merge_splits(float *o, float *p, int64_t n, int64_t stride, int64_t G, int64_t D) {
    for (int64_t g = 0; g < G; g++) {
        float top = -INFINITY, denominator = 0.0f;
        for (int64_t s = 0; s < n; s++) top = fmaxf(top, p[s * stride + G * D + g]);
        for (int64_t s = 0; s < n; s++) {
            float *ml = p + s * stride + G * D;
            ml[g] = expf(ml[g] - top);
            denominator += ml[g] * ml[G + g];
        }
        const v8 inv = splat(1.0f / denominator);
        for (int64_t c = 0; c < D; c += 8) {
            v8 sum = splat(0.0f);
            for (int64_t s = 0; s < n; s++) sum += load8_f32(p + s * stride + g * D + c) * splat(p[s * stride + G * D + g]);
            store8(o + g * D + c, sum * inv);
        }
    }
}

/* The entry point for cache element type T: returns 0, or -1 for shapes this kernel
 * does not handle, or with no memory for the runs' sums (the caller then falls back to torch). */
#define DEFINE_DECODE_ATTENTION(NAME, T, LOAD, STORE, KT, WIDEN, PERMUTED)                                       \
    DEFINE_HEAD(NAME, T, LOAD, STORE, KT, WIDEN, PERMUTED, 64)                                                   \
    DEFINE_HEAD(NAME, T, LOAD, STORE, KT, WIDEN, PERMUTED, 96)                                                   \
    DEFINE_HEAD(NAME, T, LOAD, STORE, KT, WIDEN, PERMUTED, 128)                                                  \
    DEFINE_HEAD(NAME, T, LOAD, STORE, KT, WIDEN, PERMUTED, 256)                                                  \
    int paged_decode_attention_##NAME(T *out, const T *q, int64_t q_stride, const KT *k_cache,                   \
                                      const KT *v_cache,                                                         \
                                      const int32_t *block_table, int64_t table_stride, const int32_t *seq_lens, \
                                      int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,                 \
                                      int64_t head_dim, int64_t block_size, float scale, int64_t window,         \
                                      float softcap) {                                                           \
        const int64_t group = num_heads / num_kv_heads;                                                          \
        if (group < 1 || group > 8 || group * num_kv_heads != num_heads) return -1;                              \
        void (*fn)(float *, float *, const T *, const KT *, const KT *, const int32_t *, int64_t, int64_t,        \
                   int64_t, int64_t, int64_t, float, float, float *, int64_t, int64_t, float *) =                \
            head_dim == 64    ? head_##NAME##_64                                                                 \
            : head_dim == 96  ? head_##NAME##_96                                                                 \
            : head_dim == 128 ? head_##NAME##_128                                                                \
            : head_dim == 256 ? head_##NAME##_256                                                                \
                              : NULL;                                                                            \
        if (fn == NULL) return -1;                                                                               \
        const int64_t row = num_kv_heads * head_dim, items = num_reqs * num_kv_heads, GD = group * head_dim;     \
        const int64_t stride = GD + 2 * group, want = SPLIT_ITEMS * (int64_t)omp_get_max_threads();             \
        int64_t splits = items >= want ? 1 : (want + items - 1) / items, most = 0;                               \
        for (int64_t r = 0; r < num_reqs; r++) most = seq_lens[r] > most ? seq_lens[r] : most;                  \
        if (item_splits((most + block_size - 1) / block_size, splits) == 1) splits = 1; /* none would split */  \
        float *parts = splits > 1 ? (float *)malloc(items * splits * stride * sizeof(float)) : NULL;             \
        if (splits > 1 && parts == NULL) return -1;                                                              \
        /* A few items go one at a time, or one thread would take them all; many go four at a time \
         * (fewer hand-outs: measured faster at 16 requests). */                                     \
        const int chunk = items >= 16 ? 4 : 1;                                                                   \
        _Pragma("omp parallel") {                                                                                \
            float *tmp = (float *)malloc(block_size * head_dim * sizeof(float));                                 \
            float *scores = NULL, own[8 * 256 + 16], o[8 * 256];                                                 \
            int64_t capacity = 0;                                                                                \
            _Pragma("omp for schedule(dynamic, chunk)") for (int64_t i = 0; i < items * splits; i++) {           \
                const int64_t r = i / splits / num_kv_heads, h = i / splits % num_kv_heads, s = i % splits;      \
                const int64_t len = seq_lens[r];                                                                 \
                int64_t start, base;                                                                             \
                const int64_t blocks = key_blocks(len, window, block_size, &start, &base);                       \
                const int64_t n = item_splits(blocks, splits);                                                   \
                if (s >= n) continue;                                                                            \
                const int64_t from = base + s * blocks / n * block_size;                                         \
                const int64_t to = s + 1 == n ? len : base + (s + 1) * blocks / n * block_size;                  \
                const int64_t padded = (to - from + 7) / 8 * 8;                                                  \
                if (padded * group > capacity) {                                                                 \
                    free(scores);                                                                                \
                    capacity = padded * group;                                                                   \
                    scores = (float *)malloc(capacity * sizeof(float));                                          \
                }                                                                                                \
                float *part = splits > 1 ? parts + i * stride : own;                                             \
                const int64_t kv = h * block_size * head_dim;                                                    \
                fn(part, part + GD, q + r * q_stride + h * GD, k_cache + kv, v_cache + kv,                       \
                   block_table + r * table_stride, start > from ? start : from, from, to, row, block_size, scale, \
                   softcap, scores, padded, group, tmp);                                                         \
                if (splits == 1) {                                                                               \
                    merge_splits(o, own, 1, stride, group, head_dim);                                            \
                    for (int64_t c = 0; c < GD; c += 8) STORE(out + i * GD + c, load8_f32(o + c)); /* i: the item */ \
                }                                                                                                \
            }                                                                                                    \
            if (splits > 1) {                                                                                    \
                _Pragma("omp for schedule(static)") for (int64_t it = 0; it < items; it++) {                     \
                    int64_t start, base;                                                                         \
                    const int64_t blocks = key_blocks(seq_lens[it / num_kv_heads], window, block_size, &start, &base); \
                    merge_splits(o, parts + it * splits * stride, item_splits(blocks, splits), stride, group, head_dim); \
                    for (int64_t c = 0; c < GD; c += 8) STORE(out + it * GD + c, load8_f32(o + c));             \
                }                                                                                                \
            }                                                                                                    \
            free(scores);                                                                                        \
            free(tmp);                                                                                           \
        }                                                                                                        \
        free(parts);                                                                                             \
        return 0;                                                                                                \
    }

#endif
