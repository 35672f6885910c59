/*
 * One Llama-style decoder layer for a step of decodes, in one call: the same kernels, in
 * the same order, as the layer's Python forward with the CPU plugin's ops (see
 * kiln_cpu/fused_decode.py), so the results are bit for bit the same. At decode batch
 * sizes the Python between those kernels cost half of a batch-1 step.
 *
 *   x = rms_norm(hidden), residual = hidden        (first layer)
 *   x, residual = add_rms_norm(hidden, residual)    (others)
 *   q, k, v = qkv(x); [q, k = rms_norm per head (q_norm, k_norm)]; rotary(q, k);
 *   cache <- k, v; o = attention(q, cache)
 *   x, residual = add_rms_norm(o_proj(o), residual)
 *   hidden = down(silu_and_mul(gate_up(x)))
 * (the norms in brackets where the layer has them: Qwen3's).
 * decode_moe_layer_bf16 (below) is its bf16 twin for layers whose MLP is routed experts.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tiled.h"
#include "vec.h"

/* The other kernels of this library. */
void rms_norm_f32(float *, const float *, const float *, int64_t, int64_t, int64_t, float);
void add_rms_norm_f32(float *, float *, const float *, int64_t, int64_t, float);
void rotary_f32(const int64_t *, float *, float *, const float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                int64_t);
void silu_and_mul_f32(float *, const float *, int64_t, int64_t);
void write_kv_f32(float *, float *, const float *, const float *, const int64_t *, int64_t, int64_t, int64_t,
                  int64_t, int64_t, int64_t);
void write_kv_bf16(uint16_t *, uint16_t *, const uint16_t *, const uint16_t *, const int64_t *, int64_t, int64_t,
                   int64_t, int64_t, int64_t, int64_t);
/* The attention kernels' last argument is the soft cap: 0 here, since the layouts these layers
 * serve have none (Gemma 2's norms after each sublayer keep it out of them). */
int paged_decode_attention_f32(float *, const float *, int64_t, const float *, const float *, const int32_t *,
                               int64_t, const int32_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                               int64_t, float);
int paged_decode_attention_f32_bf16(float *, const float *, int64_t, const uint16_t *, const uint16_t *,
                                    const int32_t *, int64_t, const int32_t *, int64_t, int64_t, int64_t, int64_t,
                                    int64_t, float, int64_t, float);

int lora_add_f32(float *, int64_t, const float *, int64_t, int64_t, const int64_t *, const float *, const float *,
                 const float *, int64_t, int64_t, int64_t, int64_t, const int64_t *, const int64_t *);
int lora_add_bf16w(float *, int64_t, const float *, int64_t, int64_t, const int64_t *, const uint16_t *,
                   const uint16_t *, const uint16_t *, int64_t, int64_t, int64_t, int64_t, const int64_t *,
                   const int64_t *);

/* A TiledLinear: its weight's kernel arguments, bias, and its activations (0: fp32, 1: int8 per
 * 32-input block, 2: int8 per row); under --enable-lora, its adapter slots (kiln.interfaces.lora,
 * B transposed as lora.c reads it; lora_a NULL: none); perm: the order its inputs are read in
 * (GPTQ act-order), or NULL. */
struct linear {
    int64_t fmt, int8;
    const float *scale, *min;
    const void *q;
    const float *bias;
    int64_t in, out;
    const void *lora_a, *lora_b, *lora_bias;
    int64_t lora_rank, lora_slices;
    const int64_t *lora_sizes;
    int64_t lora_bf16; /* the slots' dtype: bf16, else fp32 */
    const int64_t *lora_ranks; /* each slot's rank here */
    const int64_t *perm;
};

struct layer {
    struct linear qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
    double eps, scale;
    void *k_cache, *v_cache; /* planes (blocks, kv_heads, block_size, head_dim) */
    int64_t cache_bf16, heads, kv_heads, head_dim, window;
    const float *q_norm, *k_norm; /* (head_dim) weights of the RMS norm over each query and key head, or NULL */
};

/* What every layer of one step shares. */
struct step {
    int64_t rows, block_size, table_stride;
    const int64_t *positions, *slots;
    const int32_t *block_table, *seq_lens;
    const float *cos_sin;
    const int64_t *lora_slots; /* each row's adapter slot (-1: none); NULL: no adapters this step */
};

static int linear(const struct linear *l, const struct step *S, float *out, const float *x) {
    const int64_t rows = S->rows;
    const float *in = x;
    float *gathered = NULL;
    if (l->perm) { /* the weight's inputs are in act-order: read x in that order */
        if ((gathered = malloc(rows * l->in * sizeof(float))) == NULL) return 1;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < l->in; i++) gathered[r * l->in + i] = x[r * l->in + l->perm[i]];
        in = gathered;
    }
    int failed = l->int8 ? int8_linear(out, in, rows, l->in, (int)l->fmt, l->scale, l->min, l->q, l->bias, l->in,
                                       l->out, l->int8 == 2)
                         : tiled_linear(out, in, rows, l->in, (int)l->fmt, l->scale, l->min, l->q, l->bias, l->in, l->out);
    free(gathered);
    if (!failed && S->lora_slots && l->lora_a && l->lora_bf16)
        failed = lora_add_bf16w(out, l->out, x, l->in, rows, S->lora_slots, l->lora_a, l->lora_b, l->lora_bias, l->in,
                                l->out, l->lora_rank, l->lora_slices, l->lora_sizes, l->lora_ranks);
    else if (!failed && S->lora_slots && l->lora_a)
        failed = lora_add_f32(out, l->out, x, l->in, rows, S->lora_slots, l->lora_a, l->lora_b, l->lora_bias, l->in,
                              l->out, l->lora_rank, l->lora_slices, l->lora_sizes, l->lora_ranks);
    return failed;
}

/* hidden, residual: (rows, hidden size), updated in place (residual is written on the first
 * layer). Returns nonzero when out of memory or the attention kernel refuses the shape. */
int decode_layer(const struct layer *L, const struct step *S, float *hidden, float *residual, int64_t first) {
    const int64_t rows = S->rows, H = L->o.out, D = L->head_dim;
    const int64_t q_size = L->heads * D, kv_size = L->kv_heads * D, qkv_size = L->qkv.out;
    const int64_t inter = L->gate_up.out;
    float *normed = first ? malloc(rows * H * sizeof(float)) : NULL, *qkv = malloc(rows * qkv_size * sizeof(float));
    float *attn = malloc(rows * q_size * sizeof(float)), *gate_up = malloc(rows * inter * sizeof(float));
    float *act = malloc(rows * (inter / 2) * sizeof(float));
    uint16_t *kv16 = L->cache_bf16 ? malloc(rows * 2 * kv_size * sizeof(uint16_t)) : NULL;
    int failed = (first && normed == NULL) || qkv == NULL || attn == NULL || gate_up == NULL || act == NULL ||
                 (L->cache_bf16 && kv16 == NULL);
    if (failed) goto done;
    const float eps = (float)L->eps;
    const float *x = hidden; /* the normed input: in place, except on the first layer */
    if (first) {
        memcpy(residual, hidden, rows * H * sizeof(float));
        rms_norm_f32(normed, hidden, L->input_norm, rows, H, H, eps);
        x = normed;
    } else {
        add_rms_norm_f32(hidden, residual, L->input_norm, rows, H, eps);
    }
    if ((failed = linear(&L->qkv, S, qkv, x))) goto done;
    float *k = qkv + q_size, *v = qkv + q_size + kv_size;
    if (L->q_norm)
        for (int64_t r = 0; r < rows; r++) { /* in place: a head's values are read before written */
            rms_norm_f32(qkv + r * qkv_size, qkv + r * qkv_size, L->q_norm, L->heads, D, D, eps);
            rms_norm_f32(k + r * qkv_size, k + r * qkv_size, L->k_norm, L->kv_heads, D, D, eps);
        }
    rotary_f32(S->positions, qkv, k, S->cos_sin, rows, L->heads, L->kv_heads, D, qkv_size, qkv_size);
    if (L->cache_bf16) { /* rounded once, as the Python path's .to(bfloat16) */
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < kv_size; i++) {
                kv16[r * 2 * kv_size + i] = to_bf16(k[r * qkv_size + i]);
                kv16[r * 2 * kv_size + kv_size + i] = to_bf16(v[r * qkv_size + i]);
            }
        write_kv_bf16(L->k_cache, L->v_cache, kv16, kv16 + kv_size, S->slots, rows, L->kv_heads, D, S->block_size,
                      2 * kv_size, 2 * kv_size);
        failed = paged_decode_attention_f32_bf16(attn, qkv, qkv_size, L->k_cache, L->v_cache, S->block_table,
                                                 S->table_stride, S->seq_lens, rows, L->heads, L->kv_heads, D,
                                                 S->block_size, (float)L->scale, L->window, 0.0f);
    } else {
        write_kv_f32(L->k_cache, L->v_cache, k, v, S->slots, rows, L->kv_heads, D, S->block_size, qkv_size,
                     qkv_size);
        failed = paged_decode_attention_f32(attn, qkv, qkv_size, L->k_cache, L->v_cache, S->block_table,
                                            S->table_stride, S->seq_lens, rows, L->heads, L->kv_heads, D,
                                            S->block_size, (float)L->scale, L->window, 0.0f);
    }
    if (failed || (failed = linear(&L->o, S, hidden, attn))) goto done;
    add_rms_norm_f32(hidden, residual, L->post_norm, rows, H, eps);
    if ((failed = linear(&L->gate_up, S, gate_up, hidden))) goto done;
    silu_and_mul_f32(act, gate_up, rows, inter / 2);
    failed = linear(&L->down, S, hidden, act);
done:
    free(normed), free(qkv), free(attn), free(gate_up), free(act), free(kv16);
    return failed;
}

/* Every decoder layer of a step in one call: decode_layer on layers[0], ..., layers[n - 1] in
 * turn (the first writes residual). Returns decode_layer's first failure, else 0. */
int decode_layers(const struct layer *const *layers, int64_t n, const struct step *S, float *hidden, float *residual) {
    for (int64_t i = 0; i < n; i++) {
        const int failed = decode_layer(layers[i], S, hidden, residual, i == 0);
        if (failed) return failed;
    }
    return 0;
}

/* The other kernels of the bf16 mixture-of-experts layer below. */
void rms_norm_bf16(uint16_t *, const uint16_t *, const uint16_t *, int64_t, int64_t, int64_t, float);
void add_rms_norm_bf16(uint16_t *, uint16_t *, const uint16_t *, int64_t, int64_t, float);
void rotary_bf16(const int64_t *, uint16_t *, uint16_t *, const float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                 int64_t);
int paged_decode_attention_bf16(uint16_t *, const uint16_t *, int64_t, const uint16_t *, const uint16_t *,
                                const int32_t *, int64_t, const int32_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                                float, int64_t, float);
int linear_bf16(uint16_t *, const uint16_t *, int64_t, int64_t, const uint16_t *, const float *, int64_t);
void silu_and_mul_bf16(uint16_t *, const uint16_t *, int64_t, int64_t);
void moe_route_bf16(float *, int64_t *, const uint16_t *, int64_t, int64_t, int64_t, int64_t);
int fused_experts_bf16(uint16_t *, const uint16_t *, int64_t, int64_t, int64_t, const int64_t *, const float *, int64_t,
                       int64_t, const uint16_t *, const uint16_t *);

/* A bf16 Bf16Linear: its (out, in) weight as loaded and its bias in fp32 (NULL: none). */
struct linear_bf16w {
    const uint16_t *w;
    const float *bias;
    int64_t in, out;
};

/* A bf16 decoder layer whose MLP is routed experts (kiln.interfaces.model's PRE_NORM_MOE_LAYER). */
struct moe_layer {
    struct linear_bf16w qkv, o, gate;
    const uint16_t *input_norm, *post_norm, *w13, *w2;
    double eps, scale;
    void *k_cache, *v_cache; /* bf16 planes (blocks, kv_heads, block_size, head_dim) */
    int64_t heads, kv_heads, head_dim, window, experts, top_k, renormalize, inter;
    const uint16_t *q_norm, *k_norm; /* as struct layer's */
    /* Qwen2-MoE's shared expert (shared_gate_up.w NULL: none): gate_up (2 shared_inter, H), down
     * (H, shared_inter), and its gate (1, H) */
    struct linear_bf16w shared_gate_up, shared_down, shared_gate;
    int64_t shared_inter;
};

/* hidden += sigmoid(gate(x)) * down(silu_and_mul(gate_up(x))) for the rows of x, rounded as torch
 * rounds the Python forward's bf16 ops: sigmoid (libm's expf, as torch's scalar loop for fewer
 * elements than two of its vectors: a decode step's one per row), the product, the sum. */
static int add_shared_expert(const struct moe_layer *L, uint16_t *hidden, const uint16_t *x, int64_t rows) {
    const int64_t H = L->o.out, inter = L->shared_inter;
    uint16_t *gate_up = malloc(rows * 2 * inter * sizeof(uint16_t)), *act = malloc(rows * inter * sizeof(uint16_t));
    uint16_t *y = malloc(rows * H * sizeof(uint16_t)), *g = malloc(rows * sizeof(uint16_t));
    int failed = gate_up == NULL || act == NULL || y == NULL || g == NULL;
    if (failed) goto done;
    const struct linear_bf16w *gu = &L->shared_gate_up, *down = &L->shared_down, *gate = &L->shared_gate;
    if ((failed = linear_bf16(gate_up, x, rows, H, gu->w, gu->bias, 2 * inter))) goto done;
    silu_and_mul_bf16(act, gate_up, rows, inter);
    if ((failed = linear_bf16(y, act, rows, inter, down->w, down->bias, H))) goto done;
    if ((failed = linear_bf16(g, x, rows, H, gate->w, gate->bias, 1))) goto done;
    for (int64_t r = 0; r < rows; r++) {
        const float s = round_bf16(1.0f / (1.0f + expf(-from_bf16(g[r]))));
        for (int64_t j = 0; j < H; j++)
            hidden[r * H + j] = to_bf16(from_bf16(hidden[r * H + j]) + round_bf16(s * from_bf16(y[r * H + j])));
    }
done:
    free(gate_up), free(act), free(y), free(g);
    return failed;
}

/* decode_layer for a bf16 mixture-of-experts layer: the same kernels, in the same order, as
 * the Python forward with the CPU plugin's bf16 parts (Bf16Linear, the bf16 fused ops,
 * attention and experts), so again bit for bit the same:
 *   x, residual = rms_norm(hidden), hidden | add_rms_norm(hidden, residual)
 *   q, k, v = qkv(x); [q, k = rms_norm per head]; rotary(q, k); cache <- k, v; o = attention(q, cache)
 *   x, residual = add_rms_norm(o_proj(o), residual)
 *   hidden = fused_experts(x, moe_route(gate(x))) [+ the shared expert's, see add_shared_expert]
 * Returns nonzero when out of memory, for an id outside the experts, or when the attention
 * kernel refuses the shape. */
int decode_moe_layer_bf16(const struct moe_layer *L, const struct step *S, uint16_t *hidden, uint16_t *residual,
                          int64_t first) {
    const int64_t rows = S->rows, H = L->o.out, D = L->head_dim, E = L->experts, K = L->top_k;
    const int64_t q_size = L->heads * D, kv_size = L->kv_heads * D, qkv_size = L->qkv.out;
    uint16_t *normed = malloc(rows * H * sizeof(uint16_t)), *qkv = malloc(rows * qkv_size * sizeof(uint16_t));
    uint16_t *attn = malloc(rows * q_size * sizeof(uint16_t)), *logits = malloc(rows * E * sizeof(uint16_t));
    float *weights = malloc(rows * K * sizeof(float));
    int64_t *ids = malloc(rows * K * sizeof(int64_t));
    int failed = normed == NULL || qkv == NULL || attn == NULL || logits == NULL || weights == NULL || ids == NULL;
    if (failed) goto done;
    const float eps = (float)L->eps;
    const uint16_t *x = hidden; /* the normed input: in place, except on the first layer */
    if (first) {
        memcpy(residual, hidden, rows * H * sizeof(uint16_t));
        rms_norm_bf16(normed, hidden, L->input_norm, rows, H, H, eps);
        x = normed;
    } else {
        add_rms_norm_bf16(hidden, residual, L->input_norm, rows, H, eps);
    }
    if ((failed = linear_bf16(qkv, x, rows, H, L->qkv.w, L->qkv.bias, qkv_size))) goto done;
    uint16_t *k = qkv + q_size, *v = k + kv_size;
    if (L->q_norm)
        for (int64_t r = 0; r < rows; r++) {
            rms_norm_bf16(qkv + r * qkv_size, qkv + r * qkv_size, L->q_norm, L->heads, D, D, eps);
            rms_norm_bf16(k + r * qkv_size, k + r * qkv_size, L->k_norm, L->kv_heads, D, D, eps);
        }
    rotary_bf16(S->positions, qkv, k, S->cos_sin, rows, L->heads, L->kv_heads, D, qkv_size, qkv_size);
    write_kv_bf16(L->k_cache, L->v_cache, k, v, S->slots, rows, L->kv_heads, D, S->block_size, qkv_size, qkv_size);
    failed = paged_decode_attention_bf16(attn, qkv, qkv_size, L->k_cache, L->v_cache, S->block_table,
                                         S->table_stride, S->seq_lens, rows, L->heads, L->kv_heads, D, S->block_size,
                                         (float)L->scale, L->window, 0.0f);
    /* normed now holds the attention block's output, then the experts' input */
    if (failed || (failed = linear_bf16(normed, attn, rows, q_size, L->o.w, L->o.bias, H))) goto done;
    add_rms_norm_bf16(normed, residual, L->post_norm, rows, H, eps);
    if ((failed = linear_bf16(logits, normed, rows, H, L->gate.w, L->gate.bias, E))) goto done;
    moe_route_bf16(weights, ids, logits, rows, E, K, L->renormalize);
    failed = fused_experts_bf16(hidden, normed, rows, H, L->inter, ids, weights, K, E, L->w13, L->w2);
    if (!failed && L->shared_gate_up.w) failed = add_shared_expert(L, hidden, normed, rows);
done:
    free(normed), free(qkv), free(attn), free(logits), free(weights), free(ids);
    return failed;
}
