/* Decode attention (paged_attention.h) for fp32 queries over a narrower cache: bf16 or fp8
 * e5m2 (--kv-cache-dtype). */
#include "paged_attention.h"

DEFINE_DECODE_ATTENTION(f32_bf16, float, load8_f32, store8, uint16_t, widen_bf16, 1)
DEFINE_DECODE_ATTENTION(f32_e5m2, float, load8_f32, store8, uint8_t, widen_e5m2, 0)
