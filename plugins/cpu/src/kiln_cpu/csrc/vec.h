/*
 * Eight-float vectors shared by Kiln's CPU kernels. GCC/Clang lower them to
 * AVX/AVX-512 or NEON as the build machine allows (-march=native).
 */
#ifndef KILN_VEC_H
#define KILN_VEC_H
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

/* A block format's fmt (4, 6, 8) with F16_SCALES set: its scale and min arrays hold fp16, not
 * fp32 (kiln_cpu.tiled_weights narrows them where fp16 holds every value exactly, as GGUF's own
 * are): the same values from fewer bytes beside the codes. The kernels take the arrays as
 * `const float *` and read them through scale_at / load8_scale. */
#define F16_SCALES 0x100

/* How far ahead in a weight's bytes the kernels that stream it ask for its lines (tiled_linear.c's
 * single passes, int8_linear.c): with few rows, too few loads were in flight for memory's latency. */
#define STREAM_AHEAD 4096
static inline int block_fmt(int fmt) { return fmt & ~F16_SCALES; }

/* Scales per 32-input block of a tiled weight's format: two for fmt 6 (Q6_K's, one per 16
 * inputs), else one. */
static inline int scales_per_block(int fmt) { return block_fmt(fmt) == 6 ? 2 : 1; }

static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }

static inline v8 load8_f32(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Value i of a scale or min array: fp32, or fp16 with f16 (exact widening either way). */
static inline float scale_at(const float *p, int64_t i, int f16) {
    if (!f16) return p[i];
    _Float16 h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    return (float)h;
}

#if defined(__F16C__)
#include <immintrin.h>
#endif
/* Values i..i+7 of a scale or min array. */
static inline v8 load8_scale(const float *p, int64_t i, int f16) {
    if (!f16) return load8_f32(p + i);
#if defined(__F16C__)
    return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
#else
    v8 v;
    for (int k = 0; k < 8; k++) v[k] = scale_at(p, i + k, 1);
    return v;
#endif
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

/* Eight bytes widened to int32 lanes (unsigned / signed). GCC lowers the generic
 * __builtin_convertvector of 8-bit lanes to one byte at a time, so x86 uses vpmovzx/sx. */
#if defined(__AVX2__)
#include <immintrin.h>
static inline i8 load8_u8(const uint8_t *p) {
    return (i8)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline i8 load8_s8(const int8_t *p) { return (i8)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#else
static inline i8 load8_u8(const uint8_t *p) { return (i8){p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]}; }
static inline i8 load8_s8(const int8_t *p) { return (i8){p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]}; }
#endif

static inline float hsum8(v8 a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

/* max and exp(x) for x <= 0 over a float vector type V whose lanes the int vector type I
 * matches (eight lanes here; sixteen in kernels built for AVX-512).
 * exp: Cephes' single-precision polynomial, about 1 ulp: x = n ln2 + r. */
#define DEFINE_VMAX_EXP(VMAX, EXP, V, I, SPLAT)                                   \
    static inline V VMAX(V a, V b) {                                             \
        const I take_b = a < b;                                                  \
        return (V)(((I)a & ~take_b) | ((I)b & take_b));                          \
    }                                                                            \
    static inline V EXP(V x) {                                                   \
        x = VMAX(x, SPLAT(-87.0f));                                              \
        const I n = __builtin_convertvector(x * SPLAT(1.44269504088896341f) - SPLAT(0.5f), I); \
        const V nf = __builtin_convertvector(n, V);                              \
        const V r = x - nf * SPLAT(0.693359375f) + nf * SPLAT(2.12194440e-4f);   \
        V p = SPLAT(1.9875691500e-4f);                                           \
        p = p * r + SPLAT(1.3981999507e-3f);                                     \
        p = p * r + SPLAT(8.3334519073e-3f);                                     \
        p = p * r + SPLAT(4.1665795894e-2f);                                     \
        p = p * r + SPLAT(1.6666665459e-1f);                                     \
        p = p * r + SPLAT(5.0000001201e-1f);                                     \
        p = p * r * r + r + SPLAT(1.0f);                                         \
        return p * (V)((n + 127) << 23);                                         \
    }

/* cap * tanh(s / cap), Gemma 2's soft cap on attention scores (cap > 0), over the vector types
 * of a DEFINE_VMAX_EXP and its EXP: tanh|x| = (1 - e) / (1 + e) with e = exp(-2|x|) (no
 * overflow), the sign then put back. Within ~cap * 6e-8 of the exact value. */
#define DEFINE_SOFTCAP(SOFTCAP, EXP, V, I, SPLAT)                               \
    static inline V SOFTCAP(V s, float cap) {                                    \
        const V x = s / SPLAT(cap);                                              \
        const I magnitude = (I)x & 0x7fffffff;                                   \
        const V e = EXP(SPLAT(-2.0f) * (V)magnitude);                            \
        const V t = (SPLAT(1.0f) - e) / (SPLAT(1.0f) + e);                       \
        return SPLAT(cap) * (V)((I)t | ((I)x ^ magnitude));                      \
    }

DEFINE_VMAX_EXP(vmax, exp8_nonpositive, v8, i8, splat)
DEFINE_SOFTCAP(softcap8, exp8_nonpositive, v8, i8, splat)

static inline v8 vselect(i8 mask, v8 a, v8 b) { return (v8)(((i8)a & mask) | ((i8)b & ~mask)); }

/* x * sigmoid(z), with exp taken of -|z| only (no overflow). */
static inline v8 times_sigmoid8(v8 x, v8 z) {
    const i8 positive = z >= splat(0.0f);
    const v8 e = exp8_nonpositive(vselect(positive, -z, z));
    return x * vselect(positive, splat(1.0f), e) / (splat(1.0f) + e);
}

static inline float times_sigmoid1(float x, float z) {
    const float e = expf(-fabsf(z));
    return x * (z >= 0.0f ? 1.0f : e) / (1.0f + e);
}

/* silu(g) = g * sigmoid(g) */
static inline v8 silu8(v8 g) { return times_sigmoid8(g, g); }
static inline float silu1(float g) { return times_sigmoid1(g, g); }

/* GELU's tanh form (Gemma's gelu_pytorch_tanh), 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715
 * x^3), as x * sigmoid(2u): the same value, from one exp that cannot overflow. */
static inline v8 gelu_tanh8(v8 x) {
    return times_sigmoid8(x, splat(1.5957691216057308f) * (x + splat(0.044715f) * x * x * x));
}
static inline float gelu_tanh1(float x) { return times_sigmoid1(x, 1.5957691216057308f * (x + 0.044715f * x * x * x)); }

/* VL-float vectors: sixteen lanes where the build targets AVX-512, else eight. */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));

/* x in every lane: a broadcast (`(vf){0} + x` cost an add first, 0 + x not being x for -0). */
static inline vf splatf(float x) {
#if VL == 16
    return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
    return (vf){x, x, x, x, x, x, x, x};
#endif
}

static inline vf loadf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storef(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* VL bf16 values widened to fp32 (load8_bf16's shift, VL lanes at a time; GCC splits the generic
 * 16-lane widening into halves, so AVX-512 says vpmovzxwd itself). */
static inline vf loadf_bf16(const uint16_t *p) {
#if VL == 16
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    return load8_bf16(p);
#endif
}

/* fp32 -> bf16, round to nearest even (inputs are finite). */
static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline float round_bf16(float x) { return from_bf16(to_bf16(x)); }

static inline float id_f32(float x) { return x; } /* an fp32 value "loaded" or "stored" as itself */

/* Round each lane to bf16 precision (nearest even), keeping it an fp32. */
static inline v8 round8_bf16(v8 v) {
    u32x8 u;
    memcpy(&u, &v, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline void store8_bf16(uint16_t *p, v8 v) {
    u32x8 u;
    memcpy(&u, &v, sizeof u);
    const u16x8 h = __builtin_convertvector((u + 0x7fffu + ((u >> 16) & 1u)) >> 16, u16x8);
    memcpy(p, &h, sizeof h);
}

static inline v8 round8_f32(v8 v) { return v; }

/* Lane j of the result is the sum of a[j]'s lanes: eight dot products finished at once
 * (pairwise adds as in x86's haddps, then the two 128-bit halves). */
static inline v8 hadd8(v8 a, v8 b) {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

static inline v8 sum_each8(const v8 a[8]) {
    const v8 lo = hadd8(hadd8(a[0], a[1]), hadd8(a[2], a[3]));  /* a0..a3: halves 0, then halves 1 */
    const v8 hi = hadd8(hadd8(a[4], a[5]), hadd8(a[6], a[7]));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

#endif
