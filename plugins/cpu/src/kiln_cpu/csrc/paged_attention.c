/* Decode attention (paged_attention.h) where the cache holds the queries' own type. */
#include "paged_attention.h"

DEFINE_DECODE_ATTENTION(f32, float, load8_f32, store8, float, widen_f32, 0)
DEFINE_DECODE_ATTENTION(bf16, uint16_t, load8_bf16, store8_bf16, uint16_t, widen_bf16, 1)
