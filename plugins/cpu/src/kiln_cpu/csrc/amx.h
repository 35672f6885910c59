/*
 * What the kernels that multiply on AMX tiles share (int8_linear.c, bf16_linear.c, experts.c):
 * the process's permission to use them, a thread's tile configuration, and the bf16 kernels'
 * layout of token rows and product of 16 weight rows. A source that includes it defines
 * _DEFAULT_SOURCE before its first include (for syscall()).
 */
#ifndef KILN_AMX_H
#define KILN_AMX_H
#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux gives a process AMX's tile registers only once it asks (arch_prctl's ARCH_REQ_XCOMP_PERM
 * for XFEATURE_XTILEDATA); without, a tile instruction faults. Asked once a process (the answer
 * is the same for every thread, and a second asker gets it again). */
static inline int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return permitted;
}

/* Loads a configuration of n tiles, tile i of rows[i] rows of colsb[i] bytes, for the calling
 * thread; it holds until the thread releases its tiles (_tile_release). */
static inline void amx_configure(int n, const uint8_t *rows, const uint16_t *colsb) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) config = {.palette = 1};
    for (int i = 0; i < n; i++) config.rows[i] = rows[i], config.colsb[i] = colsb[i];
    _tile_loadconfig(&config);
}

#if defined(__AMX_BF16__)
#define AMX_TOKENS 16 /* a B tile's columns: tokens */

/* Rows of a bf16 matrix as B tiles: row t's pair p of inputs at xt[(g * K / 2 + p) * 16 + j],
 * t = 16 g + j, for rows row[t] of x (K values each; row NULL: rows 0 .. T). Padding tokens are
 * left as they are (zero, from calloc). */
static inline void amx_pairs_of_rows(uint32_t *xt, const uint16_t *x, const int64_t *row, int64_t T, int64_t K) {
    const int64_t pairs = K / 2;
    for (int64_t t = 0; t < T; t++) {
        const uint32_t *src = (const uint32_t *)(x + (row ? row[t] : t) * K);
        uint32_t *col = xt + (t / AMX_TOKENS) * pairs * AMX_TOKENS + t % AMX_TOKENS;
        for (int64_t p = 0; p < pairs; p++) col[p * AMX_TOKENS] = src[p];
    }
}

/* c[f][j] = w's row f . token j, for 16 rows of w (row stride K, K a multiple of 32) and a group
 * of 16 tokens xg as amx_pairs_of_rows lays them out, summed in fp32 on tiles 0-5 (a thread
 * configures them as 16 rows of 64 bytes). The 16 rows of an A tile lie a K apart, as the
 * weight holds them, and their inputs in 32s go to two C tiles by turns, so that a product need
 * not wait for the one before (added at the end); a token's sums never depend on the other
 * tokens of its group. next: 16 contiguous rows of K to bring into L2 meanwhile (NULL: none):
 * loads of rows a K apart streamed at half the memory's rate without (one row through 30 layers
 * of the default model: 20.9 ms against 13.7-15.1 with; into L1, or two blocks ahead, 14.7-16.8). */
static inline void amx_bf16_sums(float c[16][AMX_TOKENS], const uint16_t *w, int64_t K, const uint32_t *xg,
                                 const uint16_t *next) {
    float odd[16][AMX_TOKENS] __attribute__((aligned(64)));
    const int64_t steps = K / 32;
    _tile_zero(0);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s += 2) {
        if (next)
            for (int64_t line = 0; line < 32; line++) __builtin_prefetch(next + s * 16 * 32 + line * 32, 0, 2);
        _tile_loadd(1, w + s * 32, K * 2);
        _tile_loadd(2, xg + s * 16 * AMX_TOKENS, AMX_TOKENS * 4);
        _tile_dpbf16ps(0, 1, 2);
        if (s + 1 < steps) {
            _tile_loadd(4, w + (s + 1) * 32, K * 2);
            _tile_loadd(5, xg + (s + 1) * 16 * AMX_TOKENS, AMX_TOKENS * 4);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, c, AMX_TOKENS * 4);
    _tile_stored(3, odd, AMX_TOKENS * 4);
    for (int f = 0; f < 16; f++)
        for (int j = 0; j < AMX_TOKENS; j++) c[f][j] += odd[f][j];
}

/* Tiles 0-5 as amx_bf16_sums uses them, for the calling thread. */
static inline void amx_bf16_configure(void) {
    static const uint8_t rows[6] = {16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[6] = {64, 64, 64, 64, 64, 64};
    amx_configure(6, rows, colsb);
}
#endif
#endif
#endif
