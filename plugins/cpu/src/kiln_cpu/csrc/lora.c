/*
 * Multi-LoRA on the CPU: every token's adapter update in one call per projection
 * (kiln.interfaces.lora.add_lora, BGMV-style: each token gathers its own slot's weights).
 *
 *   h = A[s] x[t]                       (num_slices * rank values; s = slots[t], < 0: none)
 *   y[t, off_i : off_i + n_i] += B[s, off_i : off_i + n_i, :] h[i * rank : (i + 1) * rank]  (+ bias)
 *
 * a: (num_slots, num_slices * rank, in), bt: B transposed, (num_slots, rank, out), bias:
 * (num_slots, out) or NULL, contiguous, all fp32 (lora_add_f32) or all bf16 (lora_add_bf16w);
 * x and y fp32. ranks: each slot's rank in this projection (the rest of its `rank` rows and
 * columns are zero padding, skipped), or NULL for all of them. Tokens are grouped by slot, so each slot's
 * A and B are read once per call (SGMV-style) rather than once per token: at decode batch sizes
 * re-reading them per token cost more than the products. B comes transposed so that the expand
 * adds whole rows of B^T into y (FMAs only; a dot product per output needs a horizontal sum,
 * which at LoRA's small ranks cost more than its multiplies).
 */
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

#define LORA_PARALLEL_MIN_MACS 65536
#define INLINE static inline __attribute__((always_inline))

/* Adapter weights are fp32 or bf16 (half the bytes: at decode a step reads every running
 * adapter's weights once, as many bytes as a 4-bit base model's for four rank-16 adapters);
 * products and sums are fp32 either way. `bf16` is a constant in each exported kernel. */
INLINE v8 loadw(const void *w, int64_t i, int bf16) {
    return bf16 ? load8_bf16((const uint16_t *)w + i) : load8_f32((const float *)w + i);
}

INLINE float getw(const void *w, int64_t i, int bf16) {
    if (!bf16) return ((const float *)w)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* A weight row's dot product with one token. */
INLINE float dot_w(const void *w, const float *x, int64_t n, int bf16) {
    v8 acc0 = splat(0.0f), acc1 = splat(0.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 += loadw(w, i, bf16) * load8_f32(x + i);
        acc1 += loadw(w, i + 8, bf16) * load8_f32(x + i + 8);
    }
    for (; i + 8 <= n; i += 8) acc0 += loadw(w, i, bf16) * load8_f32(x + i);
    float sum = hsum8(acc0 + acc1);
    for (; i < n; i++) sum += getw(w, i, bf16) * x[i];
    return sum;
}

/* Four tokens' dot products with one weight row, which is loaded once for all four. */
INLINE void dot4_w(const void *w, const float *const x[4], int64_t n, float out[4], int bf16) {
    v8 a0 = splat(0.0f), a1 = splat(0.0f), a2 = splat(0.0f), a3 = splat(0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8 wv = loadw(w, i, bf16);
        a0 += wv * load8_f32(x[0] + i);
        a1 += wv * load8_f32(x[1] + i);
        a2 += wv * load8_f32(x[2] + i);
        a3 += wv * load8_f32(x[3] + i);
    }
    out[0] = hsum8(a0), out[1] = hsum8(a1), out[2] = hsum8(a2), out[3] = hsum8(a3);
    for (; i < n; i++)
        for (int j = 0; j < 4; j++) out[j] += getw(w, i, bf16) * x[j][i];
}

/* The eight sums of v[0..7]'s lanes, as one vector (a transpose folded into the adds). */
static inline v8 hsum8x8(const v8 v[8]) {
#define EVEN(a, b) __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14)
#define ODD(a, b) __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15)
    const v8 p01 = EVEN(v[0], v[1]) + ODD(v[0], v[1]), p23 = EVEN(v[2], v[3]) + ODD(v[2], v[3]);
    const v8 p45 = EVEN(v[4], v[5]) + ODD(v[4], v[5]), p67 = EVEN(v[6], v[7]) + ODD(v[6], v[7]);
#undef EVEN
#undef ODD
    const v8 q03 = __builtin_shufflevector(p01, p23, 0, 1, 8, 9, 4, 5, 12, 13) +
                   __builtin_shufflevector(p01, p23, 2, 3, 10, 11, 6, 7, 14, 15);
    const v8 q47 = __builtin_shufflevector(p45, p67, 0, 1, 8, 9, 4, 5, 12, 13) +
                   __builtin_shufflevector(p45, p67, 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(q03, q47, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(q03, q47, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* y[j][0..16) += sum_r h[j][r] * bt[r * out + (0..16)] (+ bias) for n <= 4 tokens. */
INLINE void expand16x4(float *const y[4], const float *const h[4], int n, const void *bt, int64_t out, int64_t rank,
                       const void *bias, int bf16) {
    v8 acc[4][2];
    for (int j = 0; j < 4; j++) acc[j][0] = acc[j][1] = splat(0.0f);
    for (int64_t r = 0; r < rank; r++) {
        const v8 b0 = loadw(bt, r * out, bf16), b1 = loadw(bt, r * out + 8, bf16);
        for (int j = 0; j < n; j++) {
            const v8 hv = splat(h[j][r]);
            acc[j][0] += hv * b0;
            acc[j][1] += hv * b1;
        }
    }
    const v8 c0 = bias ? loadw(bias, 0, bf16) : splat(0.0f), c1 = bias ? loadw(bias, 8, bf16) : splat(0.0f);
    for (int j = 0; j < n; j++) {
        store8(y[j], load8_f32(y[j]) + acc[j][0] + c0);
        store8(y[j] + 8, load8_f32(y[j] + 8) + acc[j][1] + c1);
    }
}

/* Two weight rows' dot products with four tokens: out[k * 4 + j] = w[k] . x[j]. Each loaded
 * piece of a row or a token serves four or two products, so the loop is bound by the FMAs. */
INLINE void dot2x4_w(const void *w0p, const void *w1p, const float *const x[4], int64_t n, float out[8], int bf16) {
    v8 acc[8];
    for (int k = 0; k < 8; k++) acc[k] = splat(0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8 w0 = loadw(w0p, i, bf16), w1 = loadw(w1p, i, bf16);
        for (int j = 0; j < 4; j++) {
            const v8 xv = load8_f32(x[j] + i);
            acc[j] += w0 * xv;
            acc[4 + j] += w1 * xv;
        }
    }
    store8(out, hsum8x8(acc));
    for (; i < n; i++)
        for (int j = 0; j < 4; j++) out[j] += getw(w0p, i, bf16) * x[j][i], out[4 + j] += getw(w1p, i, bf16) * x[j][i];
}

#define LORA_TOKEN_CHUNK 16 /* tokens whose inputs stay in cache while A's rows pass over them */

INLINE int lora_add(float *y, int64_t y_stride, const float *x, int64_t x_stride, int64_t tokens, const int64_t *slots,
                    const void *a, const void *bt, const void *bias, int64_t in, int64_t out, int64_t rank,
                    int64_t num_slices, const int64_t *slice_sizes, const int64_t *ranks, int bf16) {
    const int64_t wsize = bf16 ? 2 : 4; /* bytes per weight */
    const int64_t h_len = num_slices * rank;
    int64_t num_slots = 0;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] + 1 > num_slots) num_slots = slots[t] + 1;
    if (num_slots == 0) return 0;
    /* Tokens grouped by slot (a counting sort): each slot's weights are read once per call. */
    int64_t *first = calloc(num_slots + 1, sizeof(int64_t)), *order = malloc(sizeof(int64_t) * tokens);
    float *h = malloc(sizeof(float) * tokens * h_len);
    if (first == NULL || order == NULL || h == NULL) {
        free(first), free(order), free(h);
        return 1;
    }
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= 0) first[slots[t] + 1]++;
    for (int64_t s = 0; s < num_slots; s++) first[s + 1] += first[s];
    for (int64_t s = 0, k = 0; s < num_slots; s++)
        for (int64_t t = 0; t < tokens; t++)
            if (slots[t] == s) order[k++] = t;
    /* Work items: for the shrink, a chunk of one slot's tokens by a pair of A's rows; for the
     * expand, sixteen output rows for every slot's tokens. One barrier between the two. */
    int64_t num_chunks = 0;
    for (int64_t s = 0; s < num_slots; s++) num_chunks += (first[s + 1] - first[s] + LORA_TOKEN_CHUNK - 1) / LORA_TOKEN_CHUNK;
    int64_t *chunk_slot = malloc(sizeof(int64_t) * (num_chunks ? num_chunks : 1));
    if (chunk_slot == NULL) {
        free(first), free(order), free(h);
        return 1;
    }
    for (int64_t s = 0, c = 0; s < num_slots; s++)
        for (int64_t j = first[s]; j < first[s + 1]; j += LORA_TOKEN_CHUNK) chunk_slot[c++] = s;
    const int64_t pairs = (h_len + 1) / 2, blocks = (out + 15) / 16;
    const int64_t macs = first[num_slots] * (h_len * in + out * rank);
#pragma omp parallel if (macs >= LORA_PARALLEL_MIN_MACS)
    {
        /* shrink: h[token] = A[s] x[token], a chunk of tokens per pass over two of A's rows */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < num_chunks * pairs; task++) {
            const int64_t c = task / pairs, r = 2 * (task % pairs), s = chunk_slot[c];
            int64_t j = first[s];
            for (int64_t k = c - 1; k >= 0 && chunk_slot[k] == s; k--) j += LORA_TOKEN_CHUNK; /* chunk's start */
            const int64_t end = j + LORA_TOKEN_CHUNK < first[s + 1] ? j + LORA_TOKEN_CHUNK : first[s + 1];
            /* rows past the slot's rank in their slice are zero padding: not computed, not read */
            const int64_t rs = ranks ? ranks[s] : rank;
            const int need0 = r % rank < rs, need1 = r + 1 < h_len && (r + 1) % rank < rs;
            if (!need0 && !need1) continue;
            const int64_t r1 = need0 ? r : r + 1; /* the one row, when only one is needed */
            const char *ar = (const char *)a + (s * h_len + r) * in * wsize, *ar1 = ar + (r1 - r) * in * wsize;
            const int both = need0 && need1;
            for (; j + 4 <= end; j += 4) {
                const float *xs[4] = {x + order[j] * x_stride, x + order[j + 1] * x_stride,
                                      x + order[j + 2] * x_stride, x + order[j + 3] * x_stride};
                if (both) {
                    float d[8];
                    dot2x4_w(ar, ar + in * wsize, xs, in, d, bf16);
                    for (int q = 0; q < 4; q++) h[(j + q) * h_len + r] = d[q], h[(j + q) * h_len + r + 1] = d[4 + q];
                } else {
                    float d[4];
                    dot4_w(ar1, xs, in, d, bf16);
                    for (int q = 0; q < 4; q++) h[(j + q) * h_len + r1] = d[q];
                }
            }
            for (; j < end; j++) {
                const float *xj = x + order[j] * x_stride;
                h[j * h_len + r1] = dot_w(ar1, xj, in, bf16);
                if (both) h[j * h_len + r + 1] = dot_w(ar + in * wsize, xj, in, bf16);
            }
        }
        /* expand: y[token, row] += B[s, row] h[token, slice of row] (+ bias), sixteen rows and four
         * tokens at a time; rows of a block that leaves its slice (or the output) one by one */
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++) {
            const int64_t row0 = blk * 16, stop = row0 + 16 < out ? row0 + 16 : out;
            int64_t slice0 = 0, edge0 = slice_sizes[0];
            while (row0 >= edge0) edge0 += slice_sizes[++slice0];
            for (int64_t s = 0; s < num_slots; s++) {
                const char *bts = (const char *)bt + s * rank * out * wsize;
                const char *bias_s = bias ? (const char *)bias + s * out * wsize : NULL;
                const int64_t rs = ranks ? ranks[s] : rank;
                if (rs == 0 && bias_s == NULL) continue; /* the adapter leaves this projection alone */
                if (stop == row0 + 16 && stop <= edge0) {
                    for (int64_t j = first[s]; j < first[s + 1]; j += 4) {
                        const int m = first[s + 1] - j < 4 ? (int)(first[s + 1] - j) : 4;
                        float *ys[4];
                        const float *hs[4];
                        for (int q = 0; q < m; q++) {
                            ys[q] = y + order[j + q] * y_stride + row0;
                            hs[q] = h + (j + q) * h_len + slice0 * rank;
                        }
                        expand16x4(ys, hs, m, bts + row0 * wsize, out, rs, bias_s ? bias_s + row0 * wsize : NULL,
                                   bf16);
                    }
                    continue;
                }
                int64_t i = slice0, edge = edge0;
                for (int64_t row = row0; row < stop; row++) {
                    while (row >= edge) edge += slice_sizes[++i];
                    const float add = bias_s ? getw(bias_s, row, bf16) : 0.0f;
                    for (int64_t j = first[s]; j < first[s + 1]; j++) {
                        const float *hj = h + j * h_len + i * rank;
                        float sum = add;
                        for (int64_t r = 0; r < rs; r++) sum += hj[r] * getw(bts, r * out + row, bf16);
                        y[order[j] * y_stride + row] += sum;
                    }
                }
            }
        }
    }
    free(chunk_slot);
    free(first), free(order), free(h);
    return 0;
}

int lora_add_f32(float *y, int64_t y_stride, const float *x, int64_t x_stride, int64_t tokens, const int64_t *slots,
                 const float *a, const float *bt, const float *bias, int64_t in, int64_t out, int64_t rank,
                 int64_t num_slices, const int64_t *slice_sizes, const int64_t *ranks) {
    return lora_add(y, y_stride, x, x_stride, tokens, slots, a, bt, bias, in, out, rank, num_slices, slice_sizes, ranks,
                    0);
}

int lora_add_bf16w(float *y, int64_t y_stride, const float *x, int64_t x_stride, int64_t tokens, const int64_t *slots,
                   const uint16_t *a, const uint16_t *bt, const uint16_t *bias, int64_t in, int64_t out, int64_t rank,
                   int64_t num_slices, const int64_t *slice_sizes, const int64_t *ranks) {
    return lora_add(y, y_stride, x, x_stride, tokens, slots, a, bt, bias, in, out, rank, num_slices, slice_sizes, ranks,
                    1);
}
