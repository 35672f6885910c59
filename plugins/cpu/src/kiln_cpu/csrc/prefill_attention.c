/*
 * Prefill attention for bf16 models on CPUs with AVX512-BF16, for Kiln's CPU plugin:
 * every prefill (or prefill chunk on a cached prefix) of a step in one call, keys and
 * values read from the paged cache the step has just written. torch's flash kernel
 * spent about a quarter of a bf16 prefill here (issue 20's embeddings); this one does
 * both products with vdpbf16ps (pairs of bf16 products summed into fp32 lanes).
 *
 * Work items are (sequence, kv head, CHUNK query positions). An item copies its keys
 * (the window's, up to its last position) into a contiguous buffer and interleaves its
 * values in pairs of keys, then walks tiles of ROWS positions of one query head:
 *
 *   S^T = K Q^T    lanes are the tile's rows: each key's scores are one vector per 16
 *                  rows, so softmax's maxima and sums are lane-wise (no horizontal ops);
 *                  Q^T is the tile's queries as (dim pair, row) words, each key's dim
 *                  pair is broadcast.
 *   P   = exp(S - m)  online over KEYS keys at a time (m, l: running max and sum),
 *                  masked causally and by the sliding window (w: a row at position p
 *                  sees keys p - w + 1 .. p), rounded to bf16 as pairs of keys; with a
 *                  soft cap c (Gemma 2's), S is c tanh(S / c) first.
 *   O  += P V      lanes are 16 output dims; each row's key pair is broadcast against
 *                  the values interleaved as (key pair, dim) words.
 *
 * All sums are fp32; out = O / l rounded to bf16 once. Without AVX512-BF16 the entry
 * point returns -1 and the plugin keeps torch's kernel.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prefill_items.h"
#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#define ROWS 32   /* query positions per tile: two 16-lane vectors */
#define KEYS 64   /* keys per online-softmax step */
#define CHUNK 128 /* query positions per work item */
#define KB 8      /* keys per register block of the score product */
#define MAX_D 256 /* head sizes: multiples of 32 up to Gemma's 256 */

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
static inline v16 splat16(float x) { return (v16)_mm512_set1_ps(x); }
DEFINE_VMAX_EXP(vmax16, exp16_nonpositive, v16, i16, splat16)
DEFINE_SOFTCAP(softcap16, exp16_nonpositive, v16, i16, splat16)

/* Two bf16 as one 32-bit word (a pair of dims or of keys: vdpbf16ps's operand unit). */
static inline uint32_t word(const uint16_t *p) {
    uint32_t w;
    memcpy(&w, p, sizeof w);
    return w;
}

typedef struct {
    uint16_t *keys;   /* (n + KB, D): the item's keys from key0 on, zero-padded */
    uint32_t *values; /* ((n + KB) / 2, D): (value[2j][d], value[2j + 1][d]) words */
    int64_t capacity; /* keys the buffers hold */
} Buffers;

/* Copies keys key0..end-1 of one kv head (and their values, interleaved) out of the
 * paged cache; rows up to KB past the end are zero so that register blocks may read them.
 * Returns -1 when the buffers cannot grow. */
static int gather_item(Buffers *b, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
                        int64_t key0, int64_t end, int64_t kv_head, int64_t num_kv_heads, int64_t block_size,
                        int64_t D) {
    const int64_t n = end - key0, padded = (n + KB) & ~(int64_t)1;
    if (padded > b->capacity) {
        free(b->keys);
        free(b->values);
        b->capacity = padded;
        b->keys = aligned_alloc(64, padded * D * sizeof(uint16_t));
        b->values = aligned_alloc(64, padded / 2 * D * sizeof(uint32_t));
        if (b->keys == NULL || b->values == NULL) {
            b->capacity = 0;
            return -1;
        }
    }
    memset(b->keys + n * D, 0, (padded - n) * D * sizeof(uint16_t));
    static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_loadu_si512(lo_idx), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t t = 0; t < padded; t += 2) {
        const uint16_t *rows[2] = {NULL, NULL};
        for (int i = 0; i < 2; i++) {
            const int64_t pos = key0 + t + i;
            if (pos >= end) continue;
            const int64_t at = ((int64_t)table[pos / block_size] * num_kv_heads + kv_head) * block_size +
                               pos % block_size;
            memcpy(b->keys + (t + i) * D, k_cache + at * D, D * sizeof(uint16_t));
            rows[i] = v_cache + at * D;
        }
        uint32_t *w = b->values + t / 2 * D;
        for (int64_t d = 0; d < D; d += 32) {
            const __m512i a = rows[0] ? _mm512_loadu_si512(rows[0] + d) : zero;
            const __m512i c = rows[1] ? _mm512_loadu_si512(rows[1] + d) : zero;
            _mm512_storeu_si512(w + d, _mm512_permutex2var_epi16(a, lo, c));
            _mm512_storeu_si512(w + d + 16, _mm512_permutex2var_epi16(a, hi, c));
        }
    }
    return 0;
}

/* O[r0..r0+3][d0..d0+16V) = alpha * O + P V over the step's nb keys: V vectors of 16 dims
 * (a constant at each call, so the loops unroll into registers). */
static inline __attribute__((always_inline)) void accumulate_pv(float *o, const float *alpha, const uint32_t *p,
                                                                const uint32_t *vb, int64_t r0, int64_t d0,
                                                                int64_t nb, int64_t D, const int V) {
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int v = 0; v < V; v++)
            acc[i][v] = _mm512_mul_ps(_mm512_load_ps(o + (r0 + i) * D + d0 + 16 * v), _mm512_set1_ps(alpha[r0 + i]));
    for (int64_t j = 0; j < nb / 2; j++) {
        __m512bh w[4];
        for (int v = 0; v < V; v++) w[v] = (__m512bh)_mm512_loadu_si512(vb + j * D + d0 + 16 * v);
        for (int i = 0; i < 4; i++) {
            const __m512bh pr = (__m512bh)_mm512_set1_epi32(p[j * ROWS + r0 + i]);
            for (int v = 0; v < V; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], pr, w[v]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int v = 0; v < V; v++) _mm512_store_ps(o + (r0 + i) * D + d0 + 16 * v, acc[i][v]);
}

/* One tile: `rows` (<= ROWS) query positions pos0.. of one head, strided by q_stride,
 * against the item's gathered keys key0.. (those before a row's window are masked). */
static void tile(uint16_t *out, int64_t out_stride, const uint16_t *q, int64_t q_stride, int64_t rows,
                 int64_t pos0, const Buffers *b, int64_t key0, int64_t end, int64_t window, float scale,
                 float softcap, int64_t D) {
    uint32_t qt[MAX_D / 2 * ROWS] __attribute__((aligned(64))); /* (dim pair, row) */
    float s[KEYS * ROWS] __attribute__((aligned(64)));       /* (key, row) */
    uint32_t p[KEYS / 2 * ROWS] __attribute__((aligned(64))); /* (key pair, row) bf16 pairs */
    float o[ROWS * MAX_D] __attribute__((aligned(64)));      /* (row, dim) */
    float alpha[ROWS] __attribute__((aligned(64)));
    const int64_t pairs = D / 2;
    for (int64_t r = 0; r < ROWS; r++) {
        for (int64_t c = 0; c < pairs; c++) qt[c * ROWS + r] = r < rows ? word(q + r * q_stride + 2 * c) : 0;
    }
    memset(o, 0, ROWS * D * sizeof(float));
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i pos[2] = {_mm512_add_epi32(iota, _mm512_set1_epi32(pos0)),
                            _mm512_add_epi32(iota, _mm512_set1_epi32(pos0 + 16))};
    v16 m[2] = {splat16(-FLT_MAX), splat16(-FLT_MAX)}, l[2] = {splat16(0.0f), splat16(0.0f)};
    const int64_t first = window > 0 && pos0 - window + 1 > key0 ? pos0 - window + 1 : key0;
    const int64_t last = pos0 + rows < end ? pos0 + rows : end; /* keys first..last-1 */
    for (int64_t k0 = key0 + ((first - key0) & ~(int64_t)(KB - 1)); k0 < last; k0 += KEYS) {
        const int64_t n = last - k0 < KEYS ? last - k0 : KEYS;
        const int64_t nb = (n + KB - 1) & ~(int64_t)(KB - 1);
        const uint16_t *kb = b->keys + (k0 - key0) * D;
        for (int64_t t = 0; t < nb; t += KB) {
            __m512 acc[KB][2];
            for (int i = 0; i < KB; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
            for (int64_t c = 0; c < pairs; c++) {
                const __m512bh q0 = (__m512bh)_mm512_load_si512(qt + c * ROWS);
                const __m512bh q1 = (__m512bh)_mm512_load_si512(qt + c * ROWS + 16);
                for (int i = 0; i < KB; i++) {
                    const __m512bh kv = (__m512bh)_mm512_set1_epi32(word(kb + (t + i) * D + 2 * c));
                    acc[i][0] = _mm512_dpbf16_ps(acc[i][0], q0, kv);
                    acc[i][1] = _mm512_dpbf16_ps(acc[i][1], q1, kv);
                }
            }
            for (int i = 0; i < KB; i++) {
                const __m512i key = _mm512_set1_epi32(k0 + t + i);
                for (int h = 0; h < 2; h++) {
                    __mmask16 see = _mm512_cmpge_epi32_mask(pos[h], key);
                    if (window > 0) see &= _mm512_cmplt_epi32_mask(_mm512_sub_epi32(pos[h], key), _mm512_set1_epi32(window));
                    const __m512 none = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
                    const __m512 score =
                        softcap > 0.0f
                            ? _mm512_mask_mov_ps(none, see, (__m512)softcap16((v16)_mm512_mul_ps(acc[i][h], sc), softcap))
                            : _mm512_mask_mul_ps(none, see, acc[i][h], sc);
                    _mm512_store_ps(s + (t + i) * ROWS + 16 * h, score);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            v16 mx = m[h];
            for (int64_t t = 0; t < nb; t++) mx = vmax16(mx, (v16)_mm512_load_ps(s + t * ROWS + 16 * h));
            const v16 a = exp16_nonpositive(m[h] - mx);
            v16 sum = splat16(0.0f);
            for (int64_t t = 0; t < nb; t++) {
                const __m512 st = _mm512_load_ps(s + t * ROWS + 16 * h);
                /* masked keys are exactly 0 (the polynomial bottoms out at exp(-87)) */
                const v16 e = (v16)_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(st, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                                       (__m512)exp16_nonpositive((v16)st - mx));
                _mm512_store_ps(s + t * ROWS + 16 * h, (__m512)e);
                sum += e;
            }
            l[h] = l[h] * a + sum;
            m[h] = mx;
            _mm512_store_ps(alpha + 16 * h, (__m512)a);
            for (int64_t t = 0; t < nb; t += 2) {
                const __m512i e0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(s + t * ROWS + 16 * h)));
                const __m512i e1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(s + (t + 1) * ROWS + 16 * h)));
                _mm512_store_si512(p + t / 2 * ROWS + 16 * h, _mm512_or_si512(e0, _mm512_slli_epi32(e1, 16)));
            }
        }
        const uint32_t *vb = b->values + (k0 - key0) / 2 * D;
        for (int64_t r0 = 0; r0 < rows; r0 += 4)
            for (int64_t d0 = 0; d0 < D; d0 += 64) { /* 64 dims a block; a last one of 32 where D % 64 is */
                if (D - d0 >= 64) accumulate_pv(o, alpha, p, vb, r0, d0, nb, D, 4);
                else accumulate_pv(o, alpha, p, vb, r0, d0, nb, D, 2);
            }
    }
    float inv[ROWS] __attribute__((aligned(64)));
    _mm512_store_ps(inv, (__m512)(splat16(1.0f) / l[0]));
    _mm512_store_ps(inv + 16, (__m512)(splat16(1.0f) / l[1]));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(out + r * out_stride + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o + r * D + d), _mm512_set1_ps(inv[r]))));
}

int prefill_attention_bf16(uint16_t *out, int64_t out_stride, const uint16_t *q, int64_t q_stride,
                           const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *block_table,
                           int64_t table_stride, const int64_t *seqs, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
                           float softcap) {
    const int64_t group = num_heads / num_kv_heads;
    if (head_dim % 32 != 0 || head_dim > MAX_D || group * num_kv_heads != num_heads) return -1;
    int64_t items;
    int64_t *item = prefill_items(seqs, num_seqs, num_kv_heads, CHUNK, &items);
    if (item == NULL) return -2;
    int failed = 0;
    _Pragma("omp parallel") {
        Buffers b = {NULL, NULL, 0};
        _Pragma("omp for schedule(dynamic, 1)") for (int64_t n = 0; n < items; n++) {
            if (failed) continue;
            const int64_t *sq = seqs + 4 * item[3 * n];
            const int64_t h = item[3 * n + 1], c = item[3 * n + 2];
            const int64_t rows = sq[1] - c < CHUNK ? sq[1] - c : CHUNK;
            const int64_t pos0 = sq[2] + c, end = pos0 + rows; /* positions of the item's queries */
            const int64_t key0 = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
            if (gather_item(&b, k_cache, v_cache, block_table + sq[3] * table_stride, key0, end, h, num_kv_heads,
                            block_size, head_dim) != 0) {
                _Pragma("omp atomic write") failed = 1;
                continue;
            }
            for (int64_t g = 0; g < group; g++) {
                const int64_t head = h * group + g;
                for (int64_t r = 0; r < rows; r += ROWS) {
                    const int64_t token = sq[0] + c + r;
                    tile(out + token * out_stride + head * head_dim, out_stride, q + token * q_stride + head * head_dim,
                         q_stride, rows - r < ROWS ? rows - r : ROWS, pos0 + r, &b, key0, end, window, scale, softcap,
                         head_dim);
                }
            }
        }
        free(b.keys);
        free(b.values);
    }
    free(item);
    return failed ? -2 : 0;
}

int prefill_attention_bf16_available(void) { return 1; }
#else
int prefill_attention_bf16(void) { return -1; }
int prefill_attention_bf16_available(void) { return 0; }
#endif
