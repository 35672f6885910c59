/*
 * The work items of Kiln's prefill attention kernels (prefill_attention.c and
 * prefill_attention_f32.c): (sequence, kv head, first of `chunk` query positions), three
 * int64 each, for seqs rows of (first token row, query length, context length, block-table
 * row). Returns the malloc'd list (the caller frees it), its length in *count; NULL when
 * out of memory.
 */
#ifndef KILN_PREFILL_ITEMS_H
#define KILN_PREFILL_ITEMS_H
#include <stdint.h>
#include <stdlib.h>

static inline int64_t *prefill_items(const int64_t *seqs, int64_t num_seqs, int64_t num_kv_heads, int64_t chunk,
                                     int64_t *count) {
    int64_t items = 0;
    for (int64_t i = 0; i < num_seqs; i++) items += num_kv_heads * ((seqs[4 * i + 1] + chunk - 1) / chunk);
    int64_t *item = malloc(3 * items * sizeof(int64_t) + 1);
    if (item == NULL) return NULL;
    for (int64_t i = 0, n = 0; i < num_seqs; i++)
        for (int64_t h = 0; h < num_kv_heads; h++)
            for (int64_t c = 0; c < seqs[4 * i + 1]; c += chunk, n++) {
                item[3 * n] = i;
                item[3 * n + 1] = h;
                item[3 * n + 2] = c;
            }
    *count = items;
    return item;
}

#endif
