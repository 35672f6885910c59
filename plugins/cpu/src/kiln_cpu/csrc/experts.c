/*
 * A mixture-of-experts layer's experts for a decode-sized batch of bf16 tokens, in one call:
 * kiln.interfaces.model.fused_experts on the stacked bf16 weights as the checkpoint holds them
 * (w13 (E, 2I, H): gate rows then up rows; w2 (E, H, I)), with no packed copy. At a few rows
 * per expert, the torch ops around each expert's two matmuls cost more than the matmuls.
 *
 * It rounds to bf16 where the reference does (each matmul's output, silu(gate), the MLP's
 * output, its product with the routing weight, and the running sum, expert by expert in
 * ascending order); what differs is the order of each dot product's sum, silu's exp (a
 * polynomial, within an ulp), and vdpbf16ps flushing denormals.
 *
 * Each output is a dot product of a row of x (or of the MLP's hidden rows) with a weight row,
 * over blocks of up to 4 rows x 4 weight rows so that a loaded vector serves several products.
 * With AVX512-BF16 a vdpbf16ps multiplies 32 bf16 pairs at once; otherwise a word of two bf16
 * is split into its even (shifted) and odd (masked) halves as fp32.
 *   phase 1: items (expert, 16 intermediate features): hidden = bf16(bf16(silu(gate)) * up)
 *   phase 2: items (16 output features), experts in ascending order within each:
 *            out = bf16(out + bf16(weight * bf16(hidden . w2)))
 * Needs H and I to be multiples of 2 * VL (32 with AVX-512, 16 otherwise: of BLOCK either way);
 * the caller checks.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tiled.h"
#include "vec.h"

void silu_and_mul_f32(float *, const float *, int64_t, int64_t); /* fused_ops.c */

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

/* d[r * BLOCK + j] = bf16(rows[r] . w[j]) for n <= ROWS rows and BLOCK weight rows: one row, two,
 * or four at a time (three: the last repeated, its sums not stored). */
#define BLOCK_DOTS(R, F)                                                                       \
    for (int f = 0; f < BLOCK; f += F) {                                                       \
        float part[R * F];                                                                     \
        dots_##R##x##F(part, rr, w + f * K, K);                                                \
        for (int64_t r = 0; r < n; r++)                                                        \
            for (int j = 0; j < F; j++) d[r * BLOCK + f + j] = round_bf16(part[r * F + j]);    \
    }
static void block_dots(float *d, const uint16_t *const *rows, int64_t n, const uint16_t *w, int64_t K) {
    const uint16_t *rr[ROWS];
    for (int r = 0; r < ROWS; r++) rr[r] = rows[r < n ? r : n - 1];
    if (n == 1) BLOCK_DOTS(1, 16)
    else if (n == 2) BLOCK_DOTS(2, 8)
    else BLOCK_DOTS(4, 4)
}

/* A step's (token, slot) pairs sorted by expert, tokens ascending within one: pair[start[e] ..
 * start[e + 1]) are expert e's; items[0 .. active) the experts with any, ascending. */
typedef struct {
    int64_t *start, *pair, *items, active;
} Routing;

static void free_routing(Routing *rt) { free(rt->start), free(rt->pair), free(rt->items); }

/* Returns 1 when out of memory, 2 for an id outside the E experts. ids (T * top_k): the slots'
 * experts, -1 for none here. */
static int sort_pairs(Routing *rt, const int64_t *ids, int64_t pairs, int64_t E) {
    for (int64_t p = 0; p < pairs; p++)
        if (ids[p] < -1 || ids[p] >= E) return 2;
    rt->start = calloc(E + 1, sizeof(int64_t));
    rt->pair = malloc((pairs > 0 ? pairs : 1) * sizeof(int64_t));
    rt->items = malloc(E * sizeof(int64_t));
    int64_t *fill = malloc(E * sizeof(int64_t));
    if (rt->start == NULL || rt->pair == NULL || rt->items == NULL || fill == NULL) {
        free(fill);
        free_routing(rt);
        return 1;
    }
    for (int64_t p = 0; p < pairs; p++)
        if (ids[p] >= 0) rt->start[ids[p] + 1]++;
    rt->active = 0;
    for (int64_t e = 0; e < E; e++) {
        rt->start[e + 1] += rt->start[e];
        if (rt->start[e + 1] > rt->start[e]) rt->items[rt->active++] = e;
    }
    memcpy(fill, rt->start, E * sizeof(int64_t));
    for (int64_t p = 0; p < pairs; p++)
        if (ids[p] >= 0) rt->pair[fill[ids[p]]++] = p;
    free(fill);
    return 0;
}

/* out (T, H) bf16 = the experts of ids (T, top_k; -1: none here) weighted by weights, on x
 * (T, H) bf16. Returns sort_pairs' error codes. */
int fused_experts_bf16(uint16_t *out, const uint16_t *x, int64_t T, int64_t H, int64_t I, const int64_t *ids,
                       const float *weights, int64_t top_k, int64_t E, const uint16_t *w13, const uint16_t *w2) {
    Routing rt;
    const int sorted = sort_pairs(&rt, ids, T * top_k, E);
    if (sorted) return sorted;
    uint16_t *hidden = malloc((T * top_k > 0 ? T * top_k : 1) * I * sizeof(uint16_t));
    if (hidden == NULL) {
        free_routing(&rt);
        return 1;
    }
    memset(out, 0, T * H * sizeof(uint16_t));
    const int64_t *start = rt.start, *pair = rt.pair, *items = rt.items, active = rt.active;
    const int64_t iblocks = I / BLOCK, hblocks = H / BLOCK;
    _Pragma("omp parallel") {
        float g[ROWS * BLOCK], u[ROWS * BLOCK];
        const uint16_t *rows[ROWS];
        _Pragma("omp for schedule(static)") for (int64_t it = 0; it < active * iblocks; it++) {
            const int64_t e = items[it / iblocks], f0 = it % iblocks * BLOCK;
            const uint16_t *gate = w13 + (e * 2 * I + f0) * H, *up = gate + I * H;
            for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += ROWS) {
                const int64_t n = start[e + 1] - p0 < ROWS ? start[e + 1] - p0 : ROWS;
                for (int64_t r = 0; r < n; r++) rows[r] = x + pair[p0 + r] / top_k * H;
                block_dots(g, rows, n, gate, H);
                block_dots(u, rows, n, up, H);
                for (int64_t r = 0; r < n; r++) {
                    uint16_t *h = hidden + (p0 + r) * I + f0;
                    const float *gr = g + r * BLOCK, *ur = u + r * BLOCK;
                    for (int j = 0; j < BLOCK; j += 8)
                        store8_bf16(h + j, round8_bf16(silu8(load8_f32(gr + j))) * load8_f32(ur + j));
                }
            }
        }
        _Pragma("omp for schedule(static)") for (int64_t it = 0; it < hblocks; it++) {
            const int64_t n0 = it * BLOCK;
            for (int64_t a = 0; a < active; a++) {
                const int64_t e = items[a];
                for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += ROWS) {
                    const int64_t n = start[e + 1] - p0 < ROWS ? start[e + 1] - p0 : ROWS;
                    for (int64_t r = 0; r < n; r++) rows[r] = hidden + (p0 + r) * I;
                    block_dots(g, rows, n, w2 + (e * H + n0) * I, I);
                    for (int64_t r = 0; r < n; r++) {
                        const int64_t p = pair[p0 + r];
                        uint16_t *o = out + p / top_k * H + n0;
                        for (int j = 0; j < BLOCK; j++)
                            o[j] = to_bf16(from_bf16(o[j]) + round_bf16(g[r * BLOCK + j] * weights[p]));
                    }
                }
            }
        }
    }
    free(hidden);
    free_routing(&rt);
    return 0;
}

/* What H and I must be multiples of. */
int fused_experts_bf16_multiple(void) { return 2 * VL; }

/* One expert's (N, K) weight in tiles (tiled_linear.c's formats). */
typedef struct {
    int64_t fmt;
    const float *scale, *min;
    const void *q;
} Tiled;

/* fused_experts_tiled with int8 activations (int8_linear, per 32-input block or per row): expert
 * by expert, each matmul split over the threads by int8_linear. */
static int experts_in_int8(float *out, const float *rows, float *hidden, const Routing *rt, int64_t H, int64_t I,
                           const float *weights, int64_t top_k, const Tiled *w13, const Tiled *w2, int per_row) {
    int64_t most = 1; /* rows of the busiest expert */
    for (int64_t a = 0; a < rt->active; a++) {
        const int64_t n = rt->start[rt->items[a] + 1] - rt->start[rt->items[a]];
        most = n > most ? n : most;
    }
    float *gate_up = malloc(most * 2 * I * sizeof(float)), *y = malloc(most * H * sizeof(float));
    int failed = gate_up == NULL || y == NULL;
    for (int64_t a = 0; a < rt->active && !failed; a++) {
        const int64_t e = rt->items[a], p0 = rt->start[e], n = rt->start[e + 1] - p0;
        float *h = hidden + p0 * I;
        failed |= int8_linear(gate_up, rows + p0 * H, n, H, (int)w13[e].fmt, w13[e].scale, w13[e].min, w13[e].q, NULL,
                              H, 2 * I, per_row);
        if (failed) break;
        silu_and_mul_f32(h, gate_up, n, I);
        failed |= int8_linear(y, h, n, I, (int)w2[e].fmt, w2[e].scale, w2[e].min, w2[e].q, NULL, I, H, per_row);
        for (int64_t r = 0; r < n; r++) {
            const int64_t p = rt->pair[p0 + r];
            float *o = out + p / top_k * H;
            for (int64_t j = 0; j < H; j++) o[j] += y[r * H + j] * weights[p];
        }
    }
    free(gate_up), free(y);
    return failed;
}

/* out (T, H) fp32 = the experts of ids (T, top_k; -1: none here) weighted by weights, on x (T, H)
 * fp32, each expert's w13 (2I, H) and w2 (H, I) in tiles: tiled_linear's products (each output
 * summed over its inputs in order), silu(gate) * up, and out += weight * expert output in
 * ascending expert order (the product and sum may fuse into one rounding). Items: (expert, 16
 * intermediate features) with its gate and up tiles, then 16 output features over every expert.
 * int8_activations 1 or 2 (TiledLinear's per-block or per-row modes): block-format experts
 * multiply in integers instead (experts_in_int8). H and I: multiples of TILE. Returns
 * sort_pairs' error codes. */
int fused_experts_tiled(float *out, const float *x, int64_t T, int64_t H, int64_t I, const int64_t *ids,
                        const float *weights, int64_t top_k, int64_t E, const Tiled *w13, const Tiled *w2,
                        int int8_activations) {
    Routing rt;
    const int sorted = sort_pairs(&rt, ids, T * top_k, E);
    if (sorted) return sorted;
    const int64_t pairs = rt.start[E] > 0 ? rt.start[E] : 1, widest = H > I ? H : I;
    float *rows = malloc(pairs * H * sizeof(float)), *hidden = malloc(pairs * I * sizeof(float));
    int failed = rows == NULL || hidden == NULL;
    if (failed) goto done;
    for (int64_t p = 0; p < rt.start[E]; p++) memcpy(rows + p * H, x + rt.pair[p] / top_k * H, H * sizeof(float));
    memset(out, 0, T * H * sizeof(float));
    if (int8_activations) {
        failed = experts_in_int8(out, rows, hidden, &rt, H, I, weights, top_k, w13, w2, int8_activations == 2);
        goto done;
    }
    const int64_t ntiles = I / TILE, active = rt.active;
    _Pragma("omp parallel") {
        float *gate_buf = malloc(2 * widest * TILE * sizeof(float)), *up_buf = gate_buf + widest * TILE;
        float g[TILE_ROWS * TILE], u[TILE_ROWS * TILE];
        if (gate_buf == NULL) {
            _Pragma("omp atomic write") failed = 1;
        }
        _Pragma("omp for schedule(static)") for (int64_t it = 0; it < active * ntiles; it++) {
            if (gate_buf == NULL) continue;
            const int64_t e = rt.items[it / ntiles], t = it % ntiles, p0 = rt.start[e], n = rt.start[e + 1] - p0;
            const Tiled *w = w13 + e;
            const Tile gate = tile_of(gate_buf, w->fmt, w->scale, w->min, w->q, t, H, n);
            const Tile up = tile_of(up_buf, w->fmt, w->scale, w->min, w->q, ntiles + t, H, n);
            for (int64_t r = 0; r < n; r += TILE_ROWS) {
                rows_times_tile(g, rows + (p0 + r) * H, n - r, H, 0, gate, NULL, 0, H, TILE);
                rows_times_tile(u, rows + (p0 + r) * H, n - r, H, 0, up, NULL, 0, H, TILE);
                for (int64_t i = 0; i < TILE_ROWS && r + i < n; i++)
                    for (int j = 0; j < TILE; j += 8)
                        store8(hidden + (p0 + r + i) * I + t * TILE + j,
                               silu8(load8_f32(g + i * TILE + j)) * load8_f32(u + i * TILE + j));
            }
        }
        _Pragma("omp for schedule(static)") for (int64_t t = 0; t < H / TILE; t++) {
            if (gate_buf == NULL) continue;
            for (int64_t a = 0; a < active; a++) {
                const int64_t e = rt.items[a], p0 = rt.start[e], n = rt.start[e + 1] - p0;
                const Tiled *w = w2 + e;
                const Tile tile = tile_of(gate_buf, w->fmt, w->scale, w->min, w->q, t, I, n);
                for (int64_t r = 0; r < n; r += TILE_ROWS) {
                    rows_times_tile(g, hidden + (p0 + r) * I, n - r, I, 0, tile, NULL, 0, I, TILE);
                    for (int64_t i = 0; i < TILE_ROWS && r + i < n; i++) {
                        const int64_t p = rt.pair[p0 + r + i];
                        float *o = out + p / top_k * H + t * TILE;
                        for (int j = 0; j < TILE; j++) o[j] += g[i * TILE + j] * weights[p];
                    }
                }
            }
        }
        free(gate_buf);
    }
done:
    free(rows), free(hidden);
    free_routing(&rt);
    return failed;
}
