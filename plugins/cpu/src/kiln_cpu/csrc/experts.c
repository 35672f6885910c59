/*
 * A mixture-of-experts layer's experts for a decode-sized batch of bf16 tokens (on AMX tiles,
 * a batch of any size), in one call:
 * kiln.interfaces.model.fused_experts on the stacked bf16 weights as the checkpoint holds them
 * (w13 (E, 2I, H): gate rows then up rows; w2 (E, H, I)), with no packed copy. At a few rows
 * per expert, the torch ops around each expert's two matmuls cost more than the matmuls.
 *
 * It rounds to bf16 where the reference does (each matmul's output, silu(gate), the MLP's
 * output, its product with the routing weight, and the running sum, expert by expert in
 * ascending order); what differs is the order of each dot product's sum, silu's exp (a
 * polynomial, within an ulp), and vdpbf16ps (and the tiles) flushing denormals.
 *
 * Each output is a dot product of a row of x (or of the MLP's hidden rows) with a weight row
 * (bf16_dots.h).
 *   phase 1: items (expert, 16 intermediate features): hidden = bf16(bf16(silu(gate)) * up)
 *   phase 2: items (expert, 16 output features): y = bf16(weight * bf16(hidden . w2)), a row
 *            of H for each of the expert's pairs
 *   then each token's rows of y, experts in ascending order: out = bf16(out + y)
 * Items an expert at a time stream w13 and w2 in order (on AMX tiles, phase 2 over every
 * expert for each 16 output features took 1.08-1.33x the time, kernel_ab at 12-256 tokens).
 * Needs H and I to be multiples of 2 * VL (32 with AVX-512, 16 otherwise: of BLOCK either way);
 * the caller checks.
 */
#define _DEFAULT_SOURCE /* syscall(), for AMX's permission (amx.h) */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16_dots.h"
#include "tiled.h"
#include "vec.h"

void silu_and_mul_f32(float *, const float *, int64_t, int64_t); /* fused_ops.c */

/* A step's (token, slot) pairs sorted by expert, tokens ascending within one: pair[start[e] ..
 * start[e + 1]) are expert e's; items[0 .. active) the experts with any, ascending; position[p]
 * pair p's place in that order (-1: another rank's expert). */
typedef struct {
    int64_t *start, *pair, *items, *position, active;
} Routing;

static void free_routing(Routing *rt) { free(rt->start), free(rt->pair), free(rt->items), free(rt->position); }

/* Returns 1 when out of memory, 2 for an id outside the E experts. ids (T * top_k): the slots'
 * experts, -1 for none here. */
static int sort_pairs(Routing *rt, const int64_t *ids, int64_t pairs, int64_t E) {
    for (int64_t p = 0; p < pairs; p++)
        if (ids[p] < -1 || ids[p] >= E) return 2;
    rt->start = calloc(E + 1, sizeof(int64_t));
    rt->pair = malloc((pairs > 0 ? pairs : 1) * sizeof(int64_t));
    rt->items = malloc(E * sizeof(int64_t));
    rt->position = malloc((pairs > 0 ? pairs : 1) * sizeof(int64_t));
    int64_t *fill = malloc(E * sizeof(int64_t));
    if (rt->start == NULL || rt->pair == NULL || rt->items == NULL || rt->position == NULL || fill == NULL) {
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
    for (int64_t p = 0; p < pairs; p++) {
        rt->position[p] = ids[p] >= 0 ? fill[ids[p]]++ : -1;
        if (ids[p] >= 0) rt->pair[rt->position[p]] = p;
    }
    free(fill);
    return 0;
}

/* out's row t = the sum of token t's kept outputs y (a row of H for each sorted pair), added in
 * their sorted order, i.e. by ascending expert, each sum rounded to bf16 (out starts at zero). */
static void add_in_expert_order(uint16_t *out, const uint16_t *y, const Routing *rt, int64_t t, int64_t top_k,
                                int64_t H) {
    uint16_t *o = out + t * H;
    for (int64_t last = -1;;) {
        int64_t i = -1;
        for (int64_t k = 0; k < top_k; k++) {
            const int64_t at = rt->position[t * top_k + k];
            if (at > last && (i < 0 || at < i)) i = at;
        }
        if (i < 0) return;
        for (int64_t n = 0; n < H; n++) o[n] = to_bf16(from_bf16(o[n]) + from_bf16(y[i * H + n]));
        last = i;
    }
}

#if defined(__AMX_BF16__) && defined(__AVX512BW__)
/* AMX: the same roundings and order of sums, each product on tiles (amx_bf16_sums): 16 weight
 * rows against a group of up to 16 of an expert's tokens. Each expert's tokens are gathered into
 * B tiles once, and phase 1 writes the hidden rows in the same layout for phase 2.
 * Against the vdpbf16ps path on bench/moe.py's 4 layers (8 experts, hidden 512, intermediate
 * 1024, top 2; 2-core AMX Xeon, kernel_ab): 0.95x the time at 12 tokens, 0.83x at 16, 0.71x at
 * 24, 0.62x at 32, 0.43x at 64, 0.27x at 256; at 2-4 tokens (~1 an expert) the tiles took
 * 1.14-1.17x, at 8 1.12x. One layer of 1024 tokens took 12.7 ms where oneDNN on each expert's
 * rows took 18.1, of 2048 21.3 against 27.0. */
#define AMX_EXPERTS 1
#define AMX_EXPERTS_MIN_ROWS 3 /* an active expert's average: fewer go to the vdpbf16ps path */

/* bf16(bf16(silu(bf16(gate))) * bf16(up)) of 8 fp32 sums each of gate and up: fp32 results whose
 * low 16 bits are zero (their bf16 in the high half) */
static inline v8 hidden8(const float *gate, const float *up) {
    return round8_bf16(round8_bf16(silu8(round8_bf16(load8_f32(gate)))) * round8_bf16(load8_f32(up)));
}

static int amx_experts_bf16(uint16_t *out, const uint16_t *x, int64_t T, int64_t H, int64_t I, const Routing *rt,
                            const float *weights, int64_t top_k, const uint16_t *w13, const uint16_t *w2) {
    const int64_t *start = rt->start, *pair = rt->pair, *items = rt->items, active = rt->active;
    const int64_t iblocks = I / BLOCK, hblocks = H / BLOCK, xtile = H / 2 * AMX_TOKENS, htile = I / 2 * AMX_TOKENS;
    const int64_t pairs = start[items[active - 1] + 1];
    int64_t *group0 = malloc((active + 1) * sizeof(int64_t)); /* active expert a's first group */
    int64_t *token = malloc(pairs * sizeof(int64_t));         /* each sorted pair's token */
    uint16_t *y = malloc(pairs * H * sizeof(uint16_t));       /* each sorted pair's weighted output */
    uint32_t *xt = NULL, *ht = NULL;
    int failed = group0 == NULL || token == NULL || y == NULL;
    if (!failed) {
        group0[0] = 0;
        for (int64_t a = 0; a < active; a++) {
            const int64_t e = items[a], n = start[e + 1] - start[e];
            group0[a + 1] = group0[a] + (n + AMX_TOKENS - 1) / AMX_TOKENS;
            for (int64_t i = start[e]; i < start[e + 1]; i++) token[i] = pair[i] / top_k;
        }
        xt = calloc(group0[active] * xtile, sizeof(uint32_t));
        ht = calloc(group0[active] * htile, sizeof(uint32_t));
        failed = xt == NULL || ht == NULL;
    }
    if (failed) return free(group0), free(token), free(y), free(xt), free(ht), 1;
    _Pragma("omp parallel") {
        _Pragma("omp for schedule(static)") for (int64_t a = 0; a < active; a++) {
            const int64_t e = items[a];
            amx_pairs_of_rows(xt + group0[a] * xtile, x, token + start[e], start[e + 1] - start[e], H);
        }
        amx_bf16_configure();
        float g[BLOCK][AMX_TOKENS] __attribute__((aligned(64))), u[BLOCK][AMX_TOKENS] __attribute__((aligned(64)));
        _Pragma("omp for schedule(static)") for (int64_t it = 0; it < active * iblocks; it++) {
            const int64_t a = it / iblocks, e = items[a], f0 = it % iblocks * BLOCK;
            const uint16_t *gate = w13 + (e * 2 * I + f0) * H, *up = gate + I * H, *next = NULL;
            if (it + 1 < active * iblocks) /* the next item's gate rows */
                next = w13 + (items[(it + 1) / iblocks] * 2 * I + (it + 1) % iblocks * BLOCK) * H;
            for (int64_t grp = group0[a]; grp < group0[a + 1]; grp++) {
                amx_bf16_sums(g, gate, H, xt + grp * xtile, grp == group0[a] ? next : NULL);
                amx_bf16_sums(u, up, H, xt + grp * xtile, grp == group0[a] && next ? next + I * H : NULL);
                uint32_t *h = ht + grp * htile + f0 / 2 * AMX_TOKENS;
                const int64_t tokens = start[e + 1] - start[e] - (grp - group0[a]) * AMX_TOKENS; /* the rest: padding */
                for (int f = 0; f < BLOCK; f += 2)
                    for (int j = 0; j < AMX_TOKENS && j < tokens; j += 8) { /* a word: feature f's bf16, then f + 1's */
                        const u32x8 even = (u32x8)hidden8(&g[f][j], &u[f][j]);
                        const u32x8 word = even >> 16 | (u32x8)hidden8(&g[f + 1][j], &u[f + 1][j]);
                        memcpy(h + f / 2 * AMX_TOKENS + j, &word, sizeof word);
                    }
            }
        }
        /* phase 2 an expert at a time (its w2 streamed in order, as phase 1 streams w13): each
         * pair's weighted output, rounded, into y by sorted pair; then each token's pairs are
         * added expert by expert in ascending order */
        _Pragma("omp for schedule(static)") for (int64_t it = 0; it < active * hblocks; it++) {
            const int64_t a = it / hblocks, e = items[a], n0 = it % hblocks * BLOCK;
            const uint16_t *next = NULL;
            if (it + 1 < active * hblocks) next = w2 + (items[(it + 1) / hblocks] * H + (it + 1) % hblocks * BLOCK) * I;
            for (int64_t grp = group0[a]; grp < group0[a + 1]; grp++) {
                amx_bf16_sums(g, w2 + (e * H + n0) * I, I, ht + grp * htile, grp == group0[a] ? next : NULL);
                const int64_t p0 = start[e] + (grp - group0[a]) * AMX_TOKENS;
                for (int64_t j = 0; j < AMX_TOKENS && p0 + j < start[e + 1]; j++) {
                    const float w = weights[pair[p0 + j]];
                    for (int f = 0; f < BLOCK; f++) y[(p0 + j) * H + n0 + f] = to_bf16(round_bf16(g[f][j]) * w);
                }
            }
        }
        _Pragma("omp for schedule(static)") for (int64_t t = 0; t < T; t++) add_in_expert_order(out, y, rt, t, top_k, H);
        _tile_release();
    }
    free(group0), free(token), free(y), free(xt), free(ht);
    return 0;
}
#endif

/* out (T, H) bf16 = the experts of ids (T, top_k; -1: none here) weighted by weights, on x
 * (T, H) bf16. Returns sort_pairs' error codes. */
int fused_experts_bf16(uint16_t *out, const uint16_t *x, int64_t T, int64_t H, int64_t I, const int64_t *ids,
                       const float *weights, int64_t top_k, int64_t E, const uint16_t *w13, const uint16_t *w2) {
    Routing rt;
    const int sorted = sort_pairs(&rt, ids, T * top_k, E);
    if (sorted) return sorted;
#if defined(AMX_EXPERTS)
    const int tiles = rt.active > 0 && rt.start[E] >= AMX_EXPERTS_MIN_ROWS * rt.active; /* this rank's pairs */
    if (tiles && H % 32 == 0 && I % 32 == 0 && amx_permitted()) {
        memset(out, 0, T * H * sizeof(uint16_t));
        const int failed = amx_experts_bf16(out, x, T, H, I, &rt, weights, top_k, w13, w2);
        free_routing(&rt);
        return failed;
    }
#endif
    uint16_t *hidden = malloc((T * top_k > 0 ? T * top_k : 1) * I * sizeof(uint16_t));
    uint16_t *y = malloc((T * top_k > 0 ? T * top_k : 1) * H * sizeof(uint16_t)); /* each sorted pair's output */
    if (hidden == NULL || y == NULL) {
        free(hidden), free(y);
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
                block_sums(g, rows, n, gate, H, 1);
                block_sums(u, rows, n, up, H, 1);
                for (int64_t r = 0; r < n; r++) {
                    uint16_t *h = hidden + (p0 + r) * I + f0;
                    const float *gr = g + r * BLOCK, *ur = u + r * BLOCK;
                    for (int j = 0; j < BLOCK; j += 8)
                        store8_bf16(h + j, round8_bf16(silu8(load8_f32(gr + j))) * load8_f32(ur + j));
                }
            }
        }
        _Pragma("omp for schedule(static)") for (int64_t it = 0; it < active * hblocks; it++) {
            const int64_t e = items[it / hblocks], n0 = it % hblocks * BLOCK;
            for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += ROWS) {
                const int64_t n = start[e + 1] - p0 < ROWS ? start[e + 1] - p0 : ROWS;
                for (int64_t r = 0; r < n; r++) rows[r] = hidden + (p0 + r) * I;
                block_sums(g, rows, n, w2 + (e * H + n0) * I, I, 1);
                for (int64_t r = 0; r < n; r++) {
                    const float w = weights[pair[p0 + r]];
                    for (int j = 0; j < BLOCK; j++) y[(p0 + r) * H + n0 + j] = to_bf16(g[r * BLOCK + j] * w);
                }
            }
        }
        _Pragma("omp for schedule(static)") for (int64_t t = 0; t < T; t++) add_in_expert_order(out, y, &rt, t, top_k, H);
    }
    free(hidden), free(y);
    free_routing(&rt);
    return 0;
}

/* What H and I must be multiples of. */
int fused_experts_bf16_multiple(void) { return 2 * VL; }

/* Whether fused_experts_bf16 multiplies on AMX tiles (from AMX_EXPERTS_MIN_ROWS an expert). */
int fused_experts_bf16_amx(void) {
#if defined(AMX_EXPERTS)
    return amx_permitted();
#else
    return 0;
#endif
}

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
            Tile gate = tile_of(gate_buf, w->fmt, w->scale, w->min, w->q, t, H, n);
            Tile up = tile_of(up_buf, w->fmt, w->scale, w->min, w->q, ntiles + t, H, n);
            /* fp32 tiles ask for the next item's as they are read. Unlike tiled_linear's single
             * passes, these paid (the MoE bench's fp32 row: 949-976 -> 1143-1172 tok/s). */
            if (w->fmt == 32 && t + 1 < ntiles) {
                gate.ahead = (const float *)gate.p + H * TILE;
                up.ahead = (const float *)up.p + H * TILE;
            }
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
                Tile tile = tile_of(gate_buf, w->fmt, w->scale, w->min, w->q, t, I, n);
                if (w->fmt == 32 && a + 1 < active && w2[rt.items[a + 1]].fmt == 32)
                    tile.ahead = (const float *)w2[rt.items[a + 1]].q + t * I * TILE;
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

/* kiln.interfaces.model.moe_route on (T, E) router logits of type T_ (fp32 or bf16): each row's
 * softmax in fp32 (libm's expf), its top_k experts by weight, highest first (the lower id first
 * among equal weights), the weights renormalised to sum to 1 if asked (summed highest first).
 * Needs top_k <= E. Four small torch ops a layer cost more than this at decode sizes. */
#define DEFINE_MOE_ROUTE(SUFFIX, T_, LD)                                                                     \
    void moe_route_##SUFFIX(float *weights, int64_t *ids, const T_ *logits, int64_t T, int64_t E,            \
                            int64_t top_k, int64_t renormalize) {                                            \
        for (int64_t t = 0; t < T; t++) {                                                                    \
            const T_ *l = logits + t * E;                                                                    \
            float p[E], m = -INFINITY, sum = 0.0f;                                                           \
            char taken[E];                                                                                   \
            memset(taken, 0, E);                                                                             \
            for (int64_t e = 0; e < E; e++) m = LD(l[e]) > m ? LD(l[e]) : m;                                 \
            for (int64_t e = 0; e < E; e++) sum += (p[e] = expf(LD(l[e]) - m));                              \
            for (int64_t e = 0; e < E; e++) p[e] /= sum;                                                     \
            float *w = weights + t * top_k, total = 0.0f;                                                    \
            int64_t *id = ids + t * top_k;                                                                   \
            for (int64_t j = 0; j < top_k; j++) {                                                            \
                int64_t best = -1;                                                                           \
                for (int64_t e = 0; e < E; e++)                                                              \
                    if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;                                 \
                w[j] = p[best], id[j] = best, total += p[best], taken[best] = 1;                             \
            }                                                                                                \
            if (renormalize)                                                                                 \
                for (int64_t j = 0; j < top_k; j++) w[j] /= total;                                           \
        }                                                                                                    \
    }
DEFINE_MOE_ROUTE(f32, float, id_f32)
DEFINE_MOE_ROUTE(bf16, uint16_t, from_bf16)
