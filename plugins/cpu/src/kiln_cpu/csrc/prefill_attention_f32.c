/*
 * Prefill attention for fp32 models, for Kiln's CPU plugin: every prefill (or prefill
 * chunk on a cached prefix) of a step in one call. A query's own prompt's keys and
 * values are read from the step's fresh K/V rows (unrounded where the cache is bf16),
 * a cached prefix's from the paged cache: in place when it is fp32, widened into a
 * buffer when bf16. torch's flash kernel ran these at 30-70 GFLOP/s here (its per-call
 * overhead on short prompts, its masked path on cached prefixes), a fraction of the
 * machine's fp32 peak; this is the bf16 kernel's scheme (prefill_attention.c) in fp32
 * FMAs on whatever vectors the compiler targets (16 lanes with AVX-512, else 8).
 *
 * Work items are (sequence, kv head, CHUNK query positions), so the query heads of a
 * group share the item's key rows. An item walks tiles of ROWS positions of one head:
 *
 *   S^T = K Q^T    lanes are the tile's rows, so softmax's maxima and sums are lane-wise;
 *                  each key's dims are broadcast against Q^T's (dim, row) vectors.
 *   P   = exp(S - m)  online over KEYS keys at a time, masked causally and by the sliding
 *                  window (a row at position p sees keys p - w + 1 .. p); with a soft cap c
 *                  (Gemma 2's), S is c tanh(S / c) first.
 *   O  += P V      lanes are output dims; each row's probability is broadcast.
 *
 * All in fp32: out = O / l.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>

#include "prefill_items.h"
#include "vec.h"

#if VL == 16
#define KB 8 /* keys per register block of the score product */
#define RB 4 /* rows per register block of the value product */
#else
#define KB 4
#define RB 2
#endif
#define ROWS (2 * VL) /* query positions per tile: two vectors */
#define DV 4          /* vectors of output dims per register block */
#define KEYS 64       /* keys per online-softmax step */
#define CHUNK 128     /* query positions per work item */
#define MAX_D 256     /* head sizes 64, 96 (Phi-3's), 128 and 256 (Gemma's): multiples of 2 VL */

typedef float vfu __attribute__((vector_size(4 * VL), aligned(4))); /* unaligned loads and stores */
static inline vi splati(int32_t x) { return (vi){0} + x; }
DEFINE_VMAX_EXP(vmaxf, expf_nonpositive, vf, vi, splatf)
DEFINE_SOFTCAP(softcapf, expf_nonpositive, vf, vi, splatf)

static const float zero_row[MAX_D] __attribute__((aligned(64)));

/* O[r0..r0+RB, d0..d0+nv VL] = alpha O + P V over nb keys (vr[j]: key j's value row): nv
 * vectors of output dims per row in registers; inlined, so nv is a constant there. */
static inline __attribute__((always_inline)) void pv_block(float *o, int64_t D, int64_t d0, int64_t r0,
                                                           const float **vr, const float *p, const float *alpha,
                                                           int64_t nb, const int nv) {
    vf acc[RB][DV];
    for (int i = 0; i < RB; i++)
        for (int v = 0; v < nv; v++) acc[i][v] = *(vfu *)(o + (r0 + i) * D + d0 + v * VL) * alpha[r0 + i];
    for (int64_t j = 0; j < nb; j++) {
        vf w[DV];
        for (int v = 0; v < nv; v++) w[v] = *(const vfu *)(vr[j] + d0 + v * VL);
        for (int i = 0; i < RB; i++) {
            const vf pr = splatf(p[j * ROWS + r0 + i]);
            for (int v = 0; v < nv; v++) acc[i][v] += pr * w[v];
        }
    }
    for (int i = 0; i < RB; i++)
        for (int v = 0; v < nv; v++) *(vfu *)(o + (r0 + i) * D + d0 + v * VL) = acc[i][v];
}

/* One tile: `rows` (<= ROWS) query positions pos0.. of one head, strided by q_stride,
 * against keys key0..end-1 (keys[i], values[i]: key key0 + i's rows; past end, zero_row).
 * `capped` is a constant where tile() inlines it: a test of the cap per score vector had made
 * uncapped prefills ~3 % slower. */
static inline __attribute__((always_inline)) void tile_of(float *out, int64_t out_stride, const float *q,
                                                          int64_t q_stride, int64_t rows, int64_t pos0,
                                                          const float **keys, const float **values, int64_t key0,
                                                          int64_t end, int64_t window, float scale, float softcap,
                                                          int64_t D, const int capped) {
    vf qt[MAX_D * 2];            /* (dim, half of the rows) */
    vf s[KEYS * 2];              /* (key, half): scores, then probabilities */
    float o[ROWS * MAX_D] __attribute__((aligned(64))); /* (row, dim) */
    float alpha[ROWS], p[KEYS * ROWS];                 /* p: (key, row) */
    for (int64_t d = 0; d < D; d++)
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < VL; r++) qt[2 * d + h][r] = h * VL + r < rows ? q[(h * VL + r) * q_stride + d] : 0.0f;
    for (int64_t i = 0; i < ROWS * D; i++) o[i] = 0.0f;
    vi pos[2];
    for (int r = 0; r < VL; r++) pos[0][r] = (int32_t)pos0 + r, pos[1][r] = (int32_t)pos0 + VL + r;
    vf m[2] = {splatf(-FLT_MAX), splatf(-FLT_MAX)}, l[2] = {splatf(0.0f), splatf(0.0f)};
    const int64_t first = window > 0 && pos0 - window + 1 > key0 ? pos0 - window + 1 : key0;
    const int64_t last = pos0 + rows < end ? pos0 + rows : end; /* keys first..last-1 */
    for (int64_t k0 = key0 + ((first - key0) & ~(int64_t)(KB - 1)); k0 < last; k0 += KEYS) {
        const int64_t n = last - k0 < KEYS ? last - k0 : KEYS;
        const int64_t nb = (n + KB - 1) & ~(int64_t)(KB - 1);
        for (int64_t t = 0; t < nb; t += KB) {
            vf acc[KB][2];
            const float *kr[KB];
            for (int i = 0; i < KB; i++) {
                acc[i][0] = acc[i][1] = splatf(0.0f);
                kr[i] = keys[k0 - key0 + t + i];
            }
            for (int64_t d = 0; d < D; d++) {
                const vf q0 = qt[2 * d], q1 = qt[2 * d + 1];
                for (int i = 0; i < KB; i++) {
                    const vf k = splatf(kr[i][d]);
                    acc[i][0] += k * q0;
                    acc[i][1] += k * q1;
                }
            }
            for (int i = 0; i < KB; i++) {
                const vi key = splati((int32_t)(k0 + t + i));
                for (int h = 0; h < 2; h++) {
                    vi see = pos[h] >= key;
                    if (window > 0) see &= (pos[h] - key) < splati((int32_t)window);
                    const vf score = capped ? softcapf(acc[i][h] * scale, softcap) : acc[i][h] * scale;
                    s[2 * (t + i) + h] = (vf)((see & (vi)score) | (~see & (vi)splatf(-INFINITY)));
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            vf mx = m[h];
            for (int64_t t = 0; t < nb; t++) mx = vmaxf(mx, s[2 * t + h]);
            const vf a = expf_nonpositive(m[h] - mx);
            vf sum = splatf(0.0f);
            for (int64_t t = 0; t < nb; t++) {
                /* masked keys are exactly 0 (the polynomial bottoms out at exp(-87)) */
                const vi live = s[2 * t + h] != splatf(-INFINITY);
                const vf e = (vf)(live & (vi)expf_nonpositive(s[2 * t + h] - mx));
                sum += e;
                *(vfu *)(p + t * ROWS + h * VL) = e;
            }
            l[h] = l[h] * a + sum;
            m[h] = mx;
            *(vfu *)(alpha + h * VL) = a;
        }
        const float **vr = values + (k0 - key0);
        for (int64_t r0 = 0; r0 < rows; r0 += RB) {
            int64_t d0 = 0;
            for (; d0 + DV * VL <= D; d0 += DV * VL) pv_block(o, D, d0, r0, vr, p, alpha, nb, DV);
            if (d0 < D) pv_block(o, D, d0, r0, vr, p, alpha, nb, 2); /* 96 with 16 lanes: 64 + 32 */
        }
    }
    float inv[ROWS];
    *(vfu *)inv = splatf(1.0f) / l[0];
    *(vfu *)(inv + VL) = splatf(1.0f) / l[1];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t d = 0; d < D; d += VL) *(vfu *)(out + r * out_stride + d) = *(vfu *)(o + r * D + d) * inv[r];
}

static void tile(float *out, int64_t out_stride, const float *q, int64_t q_stride, int64_t rows, int64_t pos0,
                 const float **keys, const float **values, int64_t key0, int64_t end, int64_t window, float scale,
                 float softcap, int64_t D) {
    if (softcap > 0.0f)
        tile_of(out, out_stride, q, q_stride, rows, pos0, keys, values, key0, end, window, scale, softcap, D, 1);
    else
        tile_of(out, out_stride, q, q_stride, rows, pos0, keys, values, key0, end, window, scale, 0.0f, D, 0);
}

/* Widens n bf16 values. */
static void widen(float *dst, const uint16_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = from_bf16(src[i]);
}

/* Arguments as prefill_attention_bf16's (prefill_attention.c), plus the step's fresh K/V
 * rows (k, v: (tokens, kv_heads, dim), rows k_stride / v_stride apart, in the queries' token order)
 * and the cache's element type (cache_bf16). */
int prefill_attention_f32(float *out, int64_t out_stride, const float *q, int64_t q_stride, const float *k,
                          const float *v, int64_t k_stride, int64_t v_stride, const void *k_cache, const void *v_cache, int cache_bf16,
                          const int32_t *block_table, int64_t table_stride, const int64_t *seqs, int64_t num_seqs,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                          int64_t window, float softcap) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0) return -1;
    if (head_dim != 64 && head_dim != 96 && head_dim != 128 && head_dim != MAX_D) return -1;
    const int64_t group = num_heads / num_kv_heads, D = head_dim;
    /* seqs: per sequence (first token row, query length, context length, block-table row) */
    int64_t items, longest = 0, context = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        if (seqs[4 * i + 1] + seqs[4 * i + 2] > longest) longest = seqs[4 * i + 1] + seqs[4 * i + 2];
        if (seqs[4 * i + 2] > context) context = seqs[4 * i + 2];
    }
    int64_t *item = prefill_items(seqs, num_seqs, num_kv_heads, CHUNK, &items);
    if (item == NULL) return -2;
    int failed = 0;
    _Pragma("omp parallel") {
        /* an item's key and value rows (KB zero rows past its end), and a bf16 prefix widened
         * (each item widens its own: a sequence's chunks and kv heads read different rows,
         * except for chunks of one head, which a long prompt's prefill splits in 128s) */
        const float **rows_of = malloc(2 * (longest + KB) * sizeof(float *));
        float *wide = cache_bf16 && context ? malloc(2 * context * D * sizeof(float)) : NULL;
        if (rows_of == NULL || (cache_bf16 && context && wide == NULL)) {
            _Pragma("omp atomic write") failed = 1;
        }
        _Pragma("omp for schedule(dynamic, 1)") for (int64_t n = 0; n < items; n++) {
            int stop;
            _Pragma("omp atomic read") stop = failed;
            if (stop) continue;
            const int64_t *sq = seqs + 4 * item[3 * n];
            const int64_t h = item[3 * n + 1], c = item[3 * n + 2];
            const int64_t rows = sq[1] - c < CHUNK ? sq[1] - c : CHUNK;
            const int64_t pos0 = sq[2] + c, end = pos0 + rows; /* positions of the item's queries */
            const int64_t key0 = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
            const int32_t *table = block_table + sq[3] * table_stride;
            const float **keys = rows_of, **values = rows_of + longest + KB;
            for (int64_t t = key0; t < end + KB; t++) {
                const float **key = keys + (t - key0), **value = values + (t - key0);
                if (t >= end) {
                    *key = *value = zero_row;
                } else if (t >= sq[2]) { /* the prompt's own: a fresh row */
                    const int64_t row = sq[0] + t - sq[2];
                    *key = k + row * k_stride + h * D, *value = v + row * v_stride + h * D;
                } else {
                    const int64_t at = ((int64_t)table[t / block_size] * num_kv_heads + h) * block_size + t % block_size;
                    if (cache_bf16) {
                        float *wk = wide + 2 * (t - key0) * D;
                        widen(wk, (const uint16_t *)k_cache + at * D, D);
                        widen(wk + D, (const uint16_t *)v_cache + at * D, D);
                        *key = wk, *value = wk + D;
                    } else {
                        *key = (const float *)k_cache + at * D, *value = (const float *)v_cache + at * D;
                    }
                }
            }
            for (int64_t g = 0; g < group; g++) {
                const int64_t head = h * group + g;
                for (int64_t r = 0; r < rows; r += ROWS) {
                    const int64_t token = sq[0] + c + r;
                    tile(out + token * out_stride + head * D, out_stride, q + token * q_stride + head * D, q_stride,
                         rows - r < ROWS ? rows - r : ROWS, pos0 + r, keys, values, key0, end, window, scale, softcap, D);
                }
            }
        }
        free(rows_of);
        free(wide);
    }
    free(item);
    return failed ? -2 : 0;
}
